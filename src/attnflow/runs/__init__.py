"""What every streamed, checkpointed run shares (the corpus study in `attnflow.corpus`, the audit
in `attnflow.dataset_audit`): the documents it reads (`readers`), its output folder, fingerprint and
checkpoint checks (`checkpoint`), the validation of its counts (`options`), Ctrl-C / SIGTERM as a
request to stop after the batch in progress (`signals`), and model replicas as Ray actors with
fault recovery (`actors`).

Each run keeps its own state, checkpoint format and outputs; the packages that run them import
from here and never from each other.
"""
