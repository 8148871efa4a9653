"""`attnflow serve` with two models (issue 46): a cheap request on one model beside heavy work on another.

    .venv/bin/python benchmarks/bench_serve_two_models.py                  # 10 rounds, budget and no budget
    .venv/bin/python benchmarks/bench_serve_two_models.py --rounds 20 --threads 2
    .venv/bin/python benchmarks/bench_serve_two_models.py --latency         # docs/serve.md's latency rows
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_serve_two_models.py --explore 16,64,128,256,512

The server runs as its own process, as a user starts it: ``attnflow serve --model minilm-sentiment
--model smollm2`` (without OMP_NUM_THREADS: torch's default threads, the machine's cores), once
with the default CPU thread budget (the threads shared out among the two models) and once with
``--threads-per-model T`` (every model on all the cores: what the server did before the budget).
Each round sends four leave-one-out requests on an 80-word review to minilm-sentiment, waits a
second (they run), then times one rollout request to smollm2 ("The capital of France is") without
per-input faithfulness (the cheap request) and one with it (the default body), then cancels what is
left of the heavy work. Printed: the cheap request's idle time, and its p50 / p95 / max beside the
heavy work, per configuration, and the load average (a shared machine stretches every time).

``--latency``: the same server (default budget), each of `LATENCY_ROWS` (model, methods, text)
asked ``--repeats`` times once warm (the first answer, which loads the model and measures its
speed, is left out), its median seconds as the client waits for it: docs/serve.md's table.

``--explore SIZES``: `/api/explore`'s estimate against its time (the server's own work functions,
in this process) on minilm-sentiment at each number of tokens: the explorer's run and its page,
every method the model supports (the expensive ones up to 128 tokens, as the explorer leaves
them out above), each view's seconds beside. The model's speed is measured again before each size
(as a server that starts then would: in the conditions the run meets), and again in CPU seconds
(`attnflow.costs.calibrate(model, clock=time.process_time)`), whose estimate is printed beside the
run's process CPU seconds, with the load average: on a machine shared with other work the wall
time stretches with the load (and a calibration taken in a busier moment than the run foresees
it longer), the CPU time does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, percentile  # noqa: E402

REVIEW = (
    "I went to see this film on a rainy Sunday afternoon with two friends who had loved the book, and we all "
    "left a little puzzled. The first hour is slow but beautifully shot, the actors are clearly committed, and "
    "the music carries several scenes that the script leaves empty. Then the plot falls apart, the villain "
    "becomes a cartoon, and the ending arrives without any reason. Still, the lead performance is wonderful and "
    "worth the ticket."
)
HEAVY = {"text": REVIEW, "model": "minilm-sentiment", "methods": ["leave_one_out"]}
CHEAP = {"text": "The capital of France is", "model": "smollm2", "methods": ["rollout"], "faithfulness": False}
DEFAULT = {**CHEAP, "faithfulness": True}
LONG_PROMPT = (
    "The Eiffel Tower was finished in 1889 for the world fair, and for forty years it was the tallest "
    "structure in the world. Today millions of visitors climb it every year. The tower stands in the city of"
)
LATENCY_ROWS = [
    ("minilm-sentiment", ["rollout"], "The movie was terrible, but the acting was great."),
    ("minilm-sentiment", ["attnlrp"], "The movie was terrible, but the acting was great."),
    ("minilm-sentiment", ["auto"], "The movie was terrible, but the acting was great."),
    ("minilm-sentiment", ["auto"], REVIEW),
    ("minilm-sentiment", ["leave_one_out"], REVIEW),
    ("smollm2", ["rollout"], "The capital of France is"),
    ("smollm2", ["attnlrp"], "The capital of France is"),
    ("smollm2", ["auto"], "The capital of France is"),
    ("smollm2", ["auto"], LONG_PROMPT),
]
ATTNFLOW = [sys.executable, "-c", "import sys; from attnflow.cli import main; sys.exit(main())"]


def start(port: int, threads: int | None) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT / "src")
    budget = ["--threads-per-model", str(threads)] if threads else []
    command = [*ATTNFLOW, "serve", "--model", "minilm-sentiment", "--model", "smollm2", "--port", str(port)]
    return subprocess.Popen([*command, "--time-limit", "300", *budget], env=env, cwd=ROOT)


async def timed(client: httpx.AsyncClient, body: dict) -> float:
    began = time.perf_counter()
    answer = await client.post("/api/explain", json=body)
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - began


async def measure(base: str, rounds: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for model in ("minilm-sentiment", "smollm2"):
            loaded = await client.post("/api/load", json={"model": model})
            assert loaded.status_code == 200, loaded.text
        await timed(client, HEAVY)  # warm: each body once
        idle = [await timed(client, CHEAP) for _ in range(5)]
        idle_default = [await timed(client, DEFAULT) for _ in range(3)]
        cheap, default, heavy_words = [], [], len(REVIEW.split())
        for round_ in range(rounds):
            ids = [f"heavy-{round_}-{i}" for i in range(4)]
            heavy = [asyncio.create_task(client.post("/api/explain", json={**HEAVY, "request_id": i})) for i in ids]
            await asyncio.sleep(1.0)
            cheap.append(await timed(client, CHEAP))
            default.append(await timed(client, DEFAULT))
            for request_id in ids:
                await client.post(f"/api/cancel/{request_id}", json={})
            await asyncio.gather(*heavy)
        return {
            "review_words": heavy_words,
            "idle_cheap_s": round(statistics.median(idle), 3),
            "idle_default_s": round(statistics.median(idle_default), 3),
            "cheap_beside_heavy": summary(cheap),
            "default_beside_heavy": summary(default),
        }


async def latency_rows(base: str, repeats: int) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for model, methods, text in LATENCY_ROWS:
            body = {"text": text, "model": model, "methods": methods}
            first = await client.post("/api/explain", json=body)  # loads and measures the model: left out
            assert first.status_code == 200, first.text
            tokens = len(first.json()["explanations"][0]["tokens"])
            times = [await timed(client, body) for _ in range(repeats)]
            row = {"model": model, "methods": methods, "tokens": tokens, "median_s": round(statistics.median(times), 2)}
            row["min_s"], row["max_s"] = round(min(times), 2), round(max(times), 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def explore_rows(sizes: list[int], model_name: str = "minilm-sentiment") -> list[dict]:
    sys.path.insert(0, str(ROOT / "src"))
    import attnflow
    from attnflow import exploration
    from attnflow.costs import Shape, calibrate, explore_parts
    from attnflow.exploration import EXPENSIVE_ABOVE
    from attnflow.methods.registry import get_method, methods_for
    from attnflow.serve import work
    from attnflow.serve.costs import Costs
    from attnflow.serve.pool import Job

    model = attnflow.load(model_name, device="cpu", progress=False)

    def chosen(n: int) -> list[str]:  # as `work.estimate_explore` keeps them
        names = methods_for(model.adapter)
        return [m for m in names if n <= EXPENSIVE_ABOVE or get_method(m).cost != "expensive"]

    costs = Costs(10_000)
    costs.ready(model_name, model)
    print("rates", costs.rates(model_name), flush=True)
    words = model.tokenizer(REVIEW * 8, add_special_tokens=False)["input_ids"]
    special = len(model.tokenizer("a")["input_ids"]) - 1
    views: dict[str, float] = {}
    viewed = exploration.method_view

    def timed_view(method, *args, **options):
        began = time.perf_counter()
        try:
            return viewed(method, *args, **options)
        finally:
            views[method] = round(time.perf_counter() - began, 2)

    exploration.method_view = timed_view
    rows = []
    for n in sizes:
        text = model.tokenizer.decode(words[: n - special])
        job = Job()
        costs.set_rates(model_name, None)
        costs.ready(model_name, model)  # measured again now, in the conditions the run meets
        work.estimate_explore(costs, job, [(model_name, model)], model.tokenizer, work.Asked(text, (model_name,)))
        cpu_rates = calibrate(model, clock=time.process_time)  # CPU seconds: what the run's CPU time is held to
        assert cpu_rates is not None
        cpu_estimate = sum(
            cpu_rates.seconds(part) for part in explore_parts(chosen(n), n, Shape.of(model), True).values()
        )
        views.clear()
        load = os.getloadavg()[0]
        began, cpu = time.perf_counter(), time.process_time()
        page = str(exploration.explore(model, text).to_html())  # as `work.explore_text` makes it
        taken, cpu_taken = time.perf_counter() - began, time.process_time() - cpu
        row = {"tokens": n, "estimated_s": job.estimate_s, "taken_s": round(taken, 2)}
        row.update(
            taken_over_estimate=round(taken / job.estimate_s, 2),
            cpu_estimated_s=round(cpu_estimate, 2),
            cpu_s=round(cpu_taken, 2),
            cpu_over_estimate=round(cpu_taken / cpu_estimate, 2),
            load_before=round(load, 1),
            page_mb=round(len(page) / 2**20, 1),
        )
        rows.append({**row, "views": dict(views)})
        print(json.dumps(rows[-1]), f"load average {os.getloadavg()}", flush=True)
    return rows


def summary(times: list[float]) -> dict:
    return {
        "p50_s": round(statistics.median(times), 3),
        "p95_s": round(percentile(times, 95), 3),
        "max_s": round(max(times), 3),
        "n": len(times),
    }


def run(threads: int | None, rounds: int, latency: int = 0) -> dict | list[dict]:
    port = free_port()
    server = start(port, threads)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/api/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            time.sleep(0.3)
        return asyncio.run(latency_rows(base, latency) if latency else measure(base, rounds))
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of heavy work and a cheap request (default 10)")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="the no-budget run's threads per model (all cores)"
    )
    parser.add_argument("--latency", action="store_true", help="docs/serve.md's warm latency rows instead")
    parser.add_argument("--repeats", type=int, default=3, help="--latency: warm requests per row (default 3)")
    parser.add_argument("--explore", metavar="SIZES", help="explore's estimate against its time at these tokens")
    args = parser.parse_args()
    if args.explore:
        explore_rows([int(size) for size in args.explore.split(",")])
        return 0
    if args.latency:
        run(None, 0, args.repeats)
        print(f"load average {os.getloadavg()}")
        return 0
    results: dict = {}
    for label, threads in (("budget (default)", None), (f"--threads-per-model {args.threads}", args.threads)):
        results[label] = run(threads, args.rounds)
        print(label, json.dumps(results[label]), f"load average {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
