"""U-shape across three hosts with edge <-> cloud latency: plain schedule vs prefetch, measured
and predicted.

Three hosts (network namespaces, ``ldt.testing.hosts``), one stage each (edge, cloud0, cloud1,
TP 1), ranks started as torchrun starts them. Each host gets its own CPU budget (0.6 of a core,
a cgroup quota) so three hosts on this 2-core machine behave like three slower machines: without
it a stage waiting on the network lends its core to the others and hides its bubbles.

The edge's two links (0 -> 1 and 2 -> 0) get an emulated one-way delay of 0, 1 and 2 t_f
(``cluster.link_delay_ms``'s mechanism), where t_f is the edge's mean chunk forward (FS, FE)
measured in this run at no delay. For every delay the plain U-shape (prefetch 0) and the
prefetching one (prefetch 1) run in the same world, alternating; a step is timed between two
world barriers. Slowdown = median step at that delay / median step of the same schedule at no
delay, per world; the bench runs ``RUNS`` worlds on fresh hosts (each measures its own t_f)
and reports the median of their slowdowns, with each world's.

Prediction: the simulator replays each schedule's action lists with the per-(stage, op) mean
times and stage offsets recorded at no delay in this run (``ldt.plan.calibrate``), with the
delay added to every message on the edge's links, and gloo's rendezvous on them (a message
leaves only once its receive's "ready" notice has crossed the link; the emulation models it
too, see docs/network.md). Prints a table and one JSON line (``ushape_latency``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

MODEL = dict(name="bench", num_layers=8, hidden_size=128, num_attention_heads=4,
             ffn_hidden_size=512, vocab_size=256, seq_length=128)
LAYOUT = "Et|ttt|ttt|tL"  # the edge: embedding + 1 layer, 1 layer + head + loss
MBS, M = 2, 32
CPUS = 0.6
DELAYS = (0, 1, 2)  # in t_f
PREFETCH = (0, 1)
CAL_REPS, REPS = 3, 7
RUNS = int(os.environ.get("LDT_BENCH_USHAPE_LATENCY_RUNS", "3"))  # worlds; figures: medians

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("U-shape step slowdown at edge link delay 1 / 2 t_f, plain schedule, 3 hosts of "
     "{cpus_per_host} core (median of {worlds} worlds; simulator)",
     "{slowdown_1tf:+.1%} / **{slowdown_2tf:+.1%}** ({predicted_slowdown_1tf:+.1%} / "
     "{predicted_slowdown_2tf:+.1%})", "-"),
    ("the same with prefetch 1 (each world's slowdown at 2 t_f)",
     "{slowdown_1tf_prefetch:+.1%} / **{slowdown_2tf_prefetch:+.1%}** "
     "({predicted_slowdown_1tf_prefetch:+.1%} / {predicted_slowdown_2tf_prefetch:+.1%}); "
     "worlds: {slowdown_2tf_prefetch_per_world}", "<= 5% at 2 t_f"),
]

# figures documents quote from the latest run (bench.summary, tests/test_bench_summary.py)
QUOTES = [
    ("docs/network.md", "the edge's chunk forward, {t_f_ms:.2f} ms in the run; medians of {worlds} "
     "worlds, {recorded[date]:.10}, load average {recorded[load][before][0]:.1f} from other "
     "work): plain U-shape {slowdown_1tf:+.1%} / {slowdown_2tf:+.1%} (simulator: "
     "{predicted_slowdown_1tf:+.1%} / {predicted_slowdown_2tf:+.1%}), prefetch 1 "
     "{slowdown_1tf_prefetch:+.1%} / {slowdown_2tf_prefetch:+.1%} (simulator: "
     "{predicted_slowdown_1tf_prefetch:+.1%} / {predicted_slowdown_2tf_prefetch:+.1%}; the "
     "worlds at 2 t_f: {slowdown_2tf_prefetch_per_world[0]:+.1%}, "
     "{slowdown_2tf_prefetch_per_world[1]:+.1%}, {slowdown_2tf_prefetch_per_world[2]:+.1%})"),
    ("docs/network.md", "waited a median {edge_delivery_late_ms[1:0]:.2f} ms past a message's due "
     "time at 1 t_f"),
]


class Lateness:
    """How late the delay emulation delivers each delayed message on this rank: the time
    ``LinkDelay.wait`` returns minus the time it was due (``ldt.boundary.work``'s rule), a
    measure of the emulation itself (thread wake-ups, the host's CPU quota), which the
    simulator does not model. A receive waited on after it was due (a prefetched one, posted
    early) counts the time the message waited for its receiver too: only the plain
    schedule's figures are the emulation's."""

    def __enter__(self):
        from ldt.boundary.work import LinkDelay

        self.values, self._original = [], LinkDelay.wait

        def wait(delay, _original=self._original):
            _original(delay)
            due = max(delay.arrived + delay.delay_s, delay.posted + 2 * delay.delay_s)
            self.values.append(time.monotonic() - due)

        LinkDelay.wait = wait
        return self

    def __exit__(self, *exc):
        from ldt.boundary.work import LinkDelay

        LinkDelay.wait = self._original


def _worker(out_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    import ldt
    from bench.common import build_chunks, make_batches, timed_step, zero_grads
    from ldt import patches
    from ldt.config import ClusterConfig, ModelConfig, StageConfig
    from ldt.boundary.communicator import VtpCommunicator
    from ldt.pipeline.forward_backward import run_step
    from ldt.training.stage import make_forward_step
    from ldt.topology.validate import validate

    dist.init_process_group("gloo")
    model = ModelConfig(**MODEL)
    cluster = ClusterConfig(stages=[StageConfig(n, "cpu", 1) for n in ("edge", "cloud0", "cloud1")],
                            u_shape=True, layout=LAYOUT)
    topo = validate(cluster, model, world_size=dist.get_world_size())
    patches.apply(["cpu_shims"])
    state = ldt.initialize_vtp(topo, timeout_s=300)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    models = build_chunks(model, topo.split, state.stage, 1, 0,
                          pg_collection=state.pg_collection())
    batches = make_batches(model, MBS, M)
    fwd = make_forward_step(model.seq_length)
    reads = state.stage in topo.data_stages()

    def with_delay(ms: float):
        """This rank's state with ``ms`` on the edge's links (what cluster.link_delay_ms sets)."""
        routes = tuple(dataclasses.replace(r, delay_ms=ms if 0 in r.boundary else 0.0)
                       for r in state.plan.routes)
        return dataclasses.replace(state, plan=dataclasses.replace(state.plan, routes=routes))

    def run(prefetch: int, st, record: bool = False):
        zero_grads(models)
        out = {}

        def step():
            out["t0"] = time.perf_counter()
            out["res"] = run_step(
                forward_step_func=fwd, data_iterator=iter(batches) if reads else None,
                model=models, num_microbatches=M, seq_length=model.seq_length,
                micro_batch_size=MBS, comm=VtpCommunicator(models[0].config, st), state=st,
                config=models[0].config, record_timings=record, prefetch=prefetch)

        elapsed = timed_step(step)
        rows = [(str(a), s - out["t0"], e - out["t0"]) for a, s, e in out["res"].timings]
        return elapsed, (out["t0"], rows)

    plain = with_delay(0.0)
    for d in (0, 0, 1):  # warm-up: allocator, autograd, connections
        run(d, plain)
    recorded = {d: [] for d in PREFETCH}  # no delay: for t_f and the simulator
    for i in range(CAL_REPS):
        for d in (PREFETCH if i % 2 == 0 else PREFETCH[::-1]):
            recorded[d].append(run(d, plain, record=True)[1])
    t_f = [0.0]
    if state.stage == 0:
        fwd_times = [e - s for rep in recorded[0] for a, s, e in rep[1] if a[1:3] in ("FS", "FE")]
        t_f[0] = statistics.fmean(fwd_times)
    holder = [t_f[0]]
    dist.broadcast_object_list(holder, src=0)
    t_f = holder[0]
    configs = [(k, d) for k in DELAYS for d in PREFETCH]
    states = {k: with_delay(k * t_f * 1e3) for k in DELAYS}
    times: dict[str, list[float]] = {f"{k}:{d}": [] for k, d in configs}
    late: dict[str, list[float]] = {f"{k}:{d}": [] for k, d in configs}
    for i in range(REPS):
        for k, d in (configs if i % 2 == 0 else configs[::-1]):
            with Lateness() as seen:
                times[f"{k}:{d}"].append(run(d, states[k])[0])
            late[f"{k}:{d}"] += seen.values
    gathered = [None] * dist.get_world_size()
    dist.gather_object((state.stage, recorded, late), gathered if dist.get_rank() == 0 else None,
                       dst=0)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"t_f": t_f, "times": times, "recorded": [g[:2] for g in gathered],
                       "late": {g[0]: g[2] for g in gathered}}, f)
    patches.revert()
    ldt.destroy_vtp()
    dist.destroy_process_group()


def _predict(recorded: list, t_f: float) -> dict[str, float]:
    """Simulated iteration per (delay, prefetch), from the no-delay action times."""
    from ldt.plan import calibrate
    from ldt.schedule import parse_action, simulate

    out = {}
    for d in PREFETCH:
        rows = [calibrate.ActionTime(i, parse_action(a), s, e, "local", t0)
                for stage, rec in recorded for i, (t0, acts) in enumerate(rec[str(d)])
                for a, s, e in acts]
        cal = calibrate.calibrate(rows)
        for k in DELAYS:
            def slow(a, delay=k * t_f):  # the edge's links
                return delay if 0 in (a.stage, a.peer) else 0

            sim = simulate(cal.schedule, cal._time, local_time=cal._time, start_at=cal.start_at,
                           comm_time=slow, handshake=slow)
            out[f"{k}:{d}"] = sim.iteration_time
    return out


def _world(tmp: str) -> dict:
    """One world on 3 fresh hosts: t_f, every step's time per (delay, prefetch), the
    simulator's iteration per (delay, prefetch)."""
    from ldt.testing.hosts import Hosts

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with Hosts(3, cpus=CPUS) as net:
        out = os.path.join(tmp, f"out{time.monotonic_ns()}.json")
        job = net.start([sys.executable, "-m", "bench.bench_ushape_latency", "--worker", out],
                        [1, 1, 1], cwd=root)
        results = job.wait(600)
        bad = [r for r in results if r.returncode != 0]
        if bad:
            raise RuntimeError(f"rank {bad[0].rank} failed ({bad[0].returncode}):\n"
                               f"{bad[0].stderr[-3000:]}")
        with open(out) as f:
            data = json.load(f)
    data["median"] = {key: statistics.median(v) for key, v in data["times"].items()}
    # the edge's delayed messages: how late each was delivered, and how many a step has
    edge = data["late"]["0"]
    data["late_ms"] = {key: (statistics.median(v) * 1e3 if v else 0.0, len(v) / REPS)
                       for key, v in edge.items()}
    data["predicted"] = _predict(data.pop("recorded"), data["t_f"])
    return data


def _slow(table: dict, k: int, d: int) -> float:
    return table[f"{k}:{d}"] / table[f"0:{d}"] - 1


def main() -> dict:
    from bench.common import machine_load, spread
    from ldt.testing.hosts import unavailable

    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return {"bench": "ushape_latency", "skipped": reason}
    started = time.perf_counter()
    load = machine_load()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [_world(tmp) for _ in range(RUNS)]
    print(f"U-shape {LAYOUT}, 3 hosts x {CPUS} core, TP 1, {M} micro-batches of {MBS}x"
          f"{MODEL['seq_length']}, hidden {MODEL['hidden_size']}; {RUNS} worlds, each: t_f "
          f"(edge chunk forward) measured, then the median of {REPS} steps per row, "
          f"alternating; slowdowns per world, then their median")
    print(f"{'one-way delay':>14} {'prefetch':>9} {'step ms (world 1)':>18} "
          f"{'slowdown per world':>28} {'median':>7} {'predicted':>10}")
    slow, pred = {}, {}
    for k in DELAYS:
        for d in PREFETCH:
            key = f"{k}:{d}"
            slow[key] = [_slow(r["median"], k, d) for r in runs]
            pred[key] = [_slow(r["predicted"], k, d) for r in runs]
            print(f"{f'{k} t_f':>14} {d:>9} {runs[0]['median'][key] * 1e3:18.1f} "
                  f"{' '.join(f'{x:+7.1%}' for x in slow[key]):>28} "
                  f"{statistics.median(slow[key]):+7.1%} {statistics.median(pred[key]):+10.1%}")
    t_f = [r["t_f"] for r in runs]
    fill = [4 * 2 * r["t_f"] / r["median"]["0:1"] for r in runs]
    late = {key: statistics.median(r["late_ms"][key][0] for r in runs) for key in slow}
    per_step = {key: runs[0]["late_ms"][key][1] for key in slow}
    print("  the edge's delayed messages per step, and how late the emulation delivered them "
          "(median ms, median of worlds): " + ", ".join(
              f"{key} {per_step[key]:.0f} x {late[key]:.2f}" for key in slow if per_step[key]))
    print(f"  t_f per world {' '.join(f'{x * 1e3:.2f}' for x in t_f)} ms; prefetch 1 / plain at "
          f"no delay: {statistics.median(r['median']['0:1'] / r['median']['0:0'] for r in runs):.3f};"
          f" the fill and drain alone pay 4 crossings of the delayed links, "
          f"{statistics.median(fill):.1%} of the step at 2 t_f")
    result = {"bench": "ushape_latency", "m": M, "cpus_per_host": CPUS, "worlds": RUNS,
              "steps_per_row": REPS,
              "t_f_ms": round(statistics.median(t_f) * 1e3, 2),
              "t_f_ms_per_world": [round(x * 1e3, 2) for x in t_f],
              "step_ms_no_delay": round(statistics.median(r["median"]["0:0"] for r in runs)
                                        * 1e3, 1),
              "prefetch_2tf_vs_plain_no_delay": round(statistics.median(
                  r["median"]["2:1"] / r["median"]["0:0"] - 1 for r in runs), 3),
              "seconds": round(time.perf_counter() - started, 1),
              "step_ms_spread": {key: spread(t * 1e3 for t in v)
                                 for key, v in runs[-1]["times"].items()},
              "edge_delayed_messages_per_step": per_step,
              "edge_delivery_late_ms": {key: round(v, 3) for key, v in late.items()},
              "load": {"before": load["loadavg"], "after": machine_load()["loadavg"]}}
    for k in DELAYS[1:]:
        for d, tag in ((0, ""), (1, "_prefetch")):
            result[f"slowdown_{k}tf{tag}"] = round(statistics.median(slow[f"{k}:{d}"]), 3)
            result[f"slowdown_{k}tf{tag}_per_world"] = [round(x, 3) for x in slow[f"{k}:{d}"]]
            result[f"predicted_slowdown_{k}tf{tag}"] = round(statistics.median(
                pred[f"{k}:{d}"]), 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        main()
