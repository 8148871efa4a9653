"""The one run engine of every dataset command (the corpus study, the audit, `evaluate`, `patch
--file`, `explain --file`; docs/runs.md) and what it is made of: `engine` (a command is a `Job`:
work items in batches, a picklable step, a mergeable result, the fields of its fingerprint; `run`
drives it locally or on Ray), `checkpoint` (`RunFolder`: the output folder, its lock, the atomic
checkpoint and the configuration check), `signals` (Ctrl-C / SIGTERM as a request to stop after
the batch in progress), `actors` (model replicas as Ray actors with fault recovery), `options`
(the validation of a run's counts) and `readers` (the documents a run reads).

The commands import from here and never from each other; nothing here imports a command.
"""
