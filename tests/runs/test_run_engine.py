"""The run engine on a toy job (no model): batches, checkpoints, Ctrl-C, --resume, the configuration
check, the output folder's rule."""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass

import pytest

from attnflow.errors import InputError
from attnflow.runs.checkpoint import RunFolder, read_checkpoint
from attnflow.runs.engine import EngineOptions, Job, Rows, run

ITEMS = list(range(10))


@dataclass(frozen=True)
class SquareStep:
    """Each item's square, one row per item; ``interrupt_at``: send this process SIGINT (Ctrl-C)
    during the batch that starts there."""

    interrupt_at: int | None = None

    def load(self, device):
        return {"device": device, "batches": []}

    def empty(self, context):  # noqa: ARG002 - the Step protocol
        return Rows()

    def run(self, context, rows, batch):
        context["batches"].append(list(batch))
        if batch[0] == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
        for item in batch:
            rows.rows[str(item)] = item * item
        return rows


class UnloadableStep(SquareStep):
    def load(self, device):  # noqa: ARG002 - the Step protocol
        raise AssertionError("a finished run loads nothing")


def job(step=SquareStep(), fields=None) -> Job:
    return Job(
        name="squares",
        unit="item",
        total=len(ITEMS),
        fields=fields or {"power": 2, "options": {"mode": "plain"}},
        step=step,
        result=Rows(),
        batches=lambda start: (ITEMS[first : first + 3] for first in range(start, len(ITEMS), 3)),
    )


def folder(out, **flags) -> RunFolder:
    return RunFolder(out, kind="squares", checkpoint="checkpoint.json", owned={"out.txt"}.__contains__,
                     state_format=1, **flags)  # fmt: skip


def test_a_run_checkpoints_and_a_resumed_finished_run_computes_nothing(tmp_path):
    context = {"batches": []}
    with folder(tmp_path) as held:
        finished = run(job(), held, EngineOptions(quiet=True), context=context)
    assert finished.result.rows == {str(i): i * i for i in ITEMS} and finished.done == 10
    assert context["batches"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    meta, state = read_checkpoint(tmp_path / "checkpoint.json")
    assert (
        meta["complete"] and meta["done"] == 10 and meta["batches"] == 4 and meta["fingerprint"] == finished.fingerprint
    )
    assert state == {"rows": finished.result.rows}
    with folder(tmp_path, resume=True) as held:  # no context: a step that had to load would fail
        again = run(job(UnloadableStep()), held, EngineOptions(quiet=True, engine="ray"))
    assert again.result.rows == finished.result.rows  # no actor, no model: nothing was left to do


def test_ctrl_c_stops_after_the_batch_and_resume_continues_after_it(tmp_path):
    context = {"batches": []}
    with pytest.raises(KeyboardInterrupt), folder(tmp_path) as held:
        run(job(SquareStep(interrupt_at=3)), held, EngineOptions(quiet=True), context=context)
    assert context["batches"] == [[0, 1, 2], [3, 4, 5]]  # the batch in progress finished
    meta, state = read_checkpoint(tmp_path / "checkpoint.json")
    assert (
        meta["done"] == 6 and not meta["complete"] and sorted(state["rows"], key=int) == ["0", "1", "2", "3", "4", "5"]
    )
    assert [entry.name for entry in tmp_path.iterdir()] == ["checkpoint.json"]  # nothing half-written beside it
    context["batches"].clear()
    with folder(tmp_path, resume=True) as held:
        finished = run(job(), held, EngineOptions(quiet=True), context=context)
    assert context["batches"] == [[6, 7, 8], [9]] and finished.result.rows == {str(i): i * i for i in ITEMS}


def test_checkpoint_every_k_batches(tmp_path):
    saved = []
    original = RunFolder.save

    def counting(self, state, meta):
        saved.append(meta["done"])
        original(self, state, meta)

    with pytest.MonkeyPatch.context() as patch, folder(tmp_path) as held:
        patch.setattr(RunFolder, "save", counting)
        run(job(), held, EngineOptions(quiet=True, checkpoint_every=3), context={"batches": []})
    assert saved == [9, 10]  # after the third batch, then at the end


def test_a_changed_configuration_is_refused_naming_each_field(tmp_path):
    with folder(tmp_path) as held:
        run(job(), held, EngineOptions(quiet=True), context={"batches": []})
    changed = {"power": 3, "options": {"mode": "plain", "extra": True}}
    with pytest.raises(InputError) as refused, folder(tmp_path, resume=True) as held:
        run(job(fields=changed), held, EngineOptions(quiet=True), context={"batches": []})
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"resume: {tmp_path / 'checkpoint.json'} was written with")
    assert "(options.extra: null then, true now; power: 2 then, 3 now)" in message
    with folder(tmp_path, resume=True) as held:  # a check of some fields only (before a model loads)
        held.check({"power": 2})
        with pytest.raises(InputError, match=r"\(power: 2 then, 4 now\)"):
            held.check({"power": 4})


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"format": 1, "do', "not a readable squares checkpoint"),
        (json.dumps({"format": 0, "done": 1}).encode(), "checkpoint format 0 is not 1 (written by another version"),
        (json.dumps({"format": 1, "done": 1}).encode(), "not a readable squares checkpoint (fields)"),
    ],
)
def test_a_damaged_or_older_checkpoint_is_one_line_and_left_as_it_was(tmp_path, content, message):
    (tmp_path / "checkpoint.json").write_bytes(content)
    with pytest.raises(InputError, match=re.escape(message)) as refused, folder(tmp_path, resume=True):
        pass
    assert "\n" not in str(refused.value) and (tmp_path / "checkpoint.json").read_bytes() == content


def test_the_output_folder_rule(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / ".attnflow-tmp-checkpoint.json-0a1b2c3d").write_text("cut short")  # left by a killed write
    with pytest.raises(InputError, match="not both"):
        folder(out, resume=True, overwrite=True)
    with (
        pytest.raises(InputError, match=r"has no checkpoint\.json, so there is no run to continue"),
        folder(out, resume=True),
    ):
        pass
    with folder(out) as held:
        run(job(), held, EngineOptions(quiet=True), context={"batches": []})
        (out / "out.txt").write_text("an output")
    assert sorted(entry.name for entry in out.iterdir()) == ["checkpoint.json", "notes.txt", "out.txt"]
    with (
        pytest.raises(InputError, match=r"holds an earlier run \(checkpoint.json, out.txt\); pass resume to continue"),
        folder(out),
    ):
        pass
    with folder(out, overwrite=True):
        assert sorted(entry.name for entry in out.iterdir()) == ["notes.txt"]  # the user's file stays


def test_bad_engine_options_are_one_line():
    with pytest.raises(InputError, match="^engine must be local or ray"):
        EngineOptions(engine="spark").check()
    with pytest.raises(InputError, match="^checkpoint_every must be at least 1"):
        EngineOptions(checkpoint_every=0).check()


def test_every_dataset_command_words_the_run_options_the_same_way():
    """--resume, --engine, --workers, --ray-address and --checkpoint-every: one wording (a --file
    command's says so first), and each help points to docs/runs.md."""
    from attnflow.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    worded = {}
    for name in ("corpus", "audit", "evaluate", "patch", "explain"):
        parser = commands[name]
        assert "docs/runs.md" in parser.format_help(), name
        for action in parser._actions:
            flag = next(
                (f for f in action.option_strings if f in ("--resume", "--engine", "--workers", "--ray-address")), None
            )
            if flag:
                worded.setdefault(flag, set()).add(action.help.removeprefix("--file: "))
    assert set(worded) == {"--resume", "--engine", "--workers", "--ray-address"}
    assert all(len(helps) == 1 for helps in worded.values()), worded
