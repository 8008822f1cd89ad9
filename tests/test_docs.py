"""The design document the code points to exists and holds every section a docstring cites by name."""
import re
from pathlib import Path

from rlsys.costs import BUILTIN_ENGINE

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"


def test_every_design_section_cited_in_the_code_exists():
    headings = {line.lstrip("#").strip() for line in DESIGN.read_text().splitlines() if line.startswith("#")}
    principles = len(re.findall(r"^\d+\. \*\*", DESIGN.read_text(), re.M))
    cited = []
    for path in (ROOT / "rlsys").rglob("*.py"):
        for match in re.finditer(r'docs/design\.md[^"\n]{0,3}((?:"[^"]+"(?:, )?)+|principle \d+)', path.read_text()):
            cited.append((path.name, match.group(1)))
    assert cited, "no docstring cites docs/design.md"
    for name, what in cited:
        if what.startswith("principle"):
            assert int(what.split()[1]) <= principles, f"{name} cites {what}; docs/design.md lists {principles}"
            continue
        for section in re.findall(r'"([^"]+)"', what):
            assert any(h.startswith(section) for h in headings), f"{name} cites docs/design.md \"{section}\""


def documented_sim_fields() -> set[str]:
    """The field paths of docs/performance.md's simulator table (`.x` after `a.b.c` stands for `a.b.x`)."""
    text = (ROOT / "docs" / "performance.md").read_text()
    table = text.split("### The simulator's config", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    fields = set()
    for line in table.splitlines()[2:]:
        parent = ""
        for name in re.findall(r"`([\w.]+)`", line.split("|")[1]):
            if name.startswith("."):
                name = parent + name
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            fields.add(name)
    return fields


def test_every_simulator_config_field_is_documented():
    from rlsys.config import Section
    from rlsys.sim.config import ElasticTPConfig, SimConfig

    expected = set()
    for name, field in SimConfig.model_fields.items():
        kind = field.annotation
        if name == "control":  # the live section's fields are documented with the live config
            expected |= {f"control.elastic_tp.{f}" for f in ElasticTPConfig.model_fields}
        elif isinstance(kind, type) and issubclass(kind, Section):
            expected |= {f"{name}.{f}" for f in kind.model_fields}
        else:
            expected.add(name)
    documented = documented_sim_fields()
    assert expected - documented == set(), "undocumented"
    assert documented - expected == set(), "documented but not a field"


# --- GPU figures: each read from benchmarks/results/gpu_*.json ----------------------------------------------
def spread(values, fmt: str = "{:.1f}") -> str:
    """"lo-hi" of the values, each in fmt."""
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def gpu_figures() -> list[tuple[str, str]]:
    """(document, phrase) for each GPU figure the docs quote, the phrase rebuilt from the results files."""
    import json

    results = ROOT / "benchmarks" / "results"
    grid = json.loads((results / "gpu_engine_h100.json").read_text())["decode_step_grid"]
    runs = json.loads((results / "gpu_runs_h100.json").read_text())
    live = json.loads((results / "gpu_live_engine_h100.json").read_text())
    in_run = runs["per_step_2026-11-26"]
    decode_ms = [s["rollout/decode_step_ms"] for run in ("tail_0.5b", "publish_object_store") for s in in_run[run]]
    ipc = [ms * 1000 for name, run in runs["runs"].items() if run["transport"] == "cuda_ipc" and name != "smoke"
           for ms in run["weight_sync_s"]]
    store = [s for run in runs["runs"].values() if run["transport"] == "object_store" for s in run["weight_sync_s"]]
    before_fix = [ms for name, series in live["in_a_run"].items() if not name.startswith(("after", "before"))
                  for ms in series.values()]
    sync = runs["per_step_sync_0.5b_2026-11-25"]
    ratio = [p["step_ms"] / p["cost_model_ms"] for p in grid]
    graph = json.loads((results / "gpu_engine_graph_h100.json").read_text())
    graph_ms = {(p["batch"], p["context"]): p["step_ms"] for p in graph["decode_step_grid"]}
    short = [ms for (b, c), ms in graph_ms.items() if c == 128]
    long = [ms for (b, c), ms in graph_ms.items() if c in (4096, "skewed")]
    mid = [ms for (b, c), ms in graph_ms.items() if c == 1024]
    attention = json.loads((results / "decode_attention_cpu.json").read_text())["rows"]
    refit = json.loads((results / "builtin_engine_fit_h100.json").read_text())
    fit, paged = refit["errors"], refit["paged_form"]["errors"]
    perf, verified, running, design = ("docs/performance.md", "docs/verified.md", "docs/running.md",
                                       "docs/design.md")
    return [
        (perf, f"graph step costs {spread(short)} ms at 128 keys for 1 to 256 sequences, the target of about 3 ms "
               f"met up to 64 sequences ({graph_ms[64, 128]:.1f} ms; {graph_ms[128, 128]:.1f} at 128), "
               f"{graph_ms[1, 128]:.1f} ms at one sequence"),
        (perf, f"{spread(mid)} ms at 1024 keys; but {spread(long)} ms at 4096 keys or skewed"),
        (perf, f"{spread([p['speedup'] for p in graph['graph_over_eager']])}x faster than the eager step"),
        (verified, f"{spread(short)} ms a step at 128 keys for 1 to 256 sequences (about 3 ms met up to 64), "
                 f"{spread(long)} ms at 4096 keys or skewed"),
        (perf, "float32 within {:.1e} for both".format(max(r[f"{a}_float32_error_over_max_output"]
                                                          for r in attention for a in ("sdpa", "split_kv")))),
        (perf, f"bf16 {spread([r['split_kv_bfloat16_error_over_max_output'] for r in attention], '{:.4f}')} for "
               f"split_kv against {spread([r['sdpa_bfloat16_error_over_max_output'] for r in attention], '{:.4f}')}"),
        (perf, f"split_kv is {spread([r['split_kv_float32_ms'] / r['sdpa_float32_ms'] for r in attention])}x slower"),
        (perf, f"{refit['fit']['overhead_s'] * 1e3:.2f} ms a step, a decode MFU of {refit['fit']['decode_mfu']} and "
               f"{refit['fit']['key_s'] * 1e6:.2f} us a key of that bucket whatever the batch (the attention's walk over "
               f"the keys), within {fit['min']:.0%} to +{fit['max']:.0%} of every point, RMS {fit['rms']:.1%} (a cost "
               f"summing the live KV, fitted the same way: {paged['min']:.0%} to +{paged['max']:.0%}, RMS "
               f"{paged['rms']:.0%})"),
        (perf, f"a prefill MFU of {BUILTIN_ENGINE['prefill_mfu']} (was 0.35)"),
        (perf, f"step costs {spread([p['step_ms'] for p in grid if p['batch'] <= 128])} ms for 1 to 128 running"),
        (perf, f"and {spread([p['step_ms'] for p in grid if p['batch'] == 256])} ms at 256"),
        (perf, f"launch-bound: {spread(ratio)}x slower than the vLLM figures"),
        (perf, f"**{spread(decode_ms)} ms a decode step**"),
        (running, f"{spread(decode_ms)} ms after)"),
        (perf, f"against {spread([s['rollout/decode_step_ms'] for s in in_run['diagnose_0.5b']], '{:.0f}')} ms in "
               "the same window before it"),
        (perf, f"(0.47B) in {spread(ipc, '{:.0f}')} ms, "
               f"{spread([s * 1000 for s in runs['runs']['smoke']['weight_sync_s']], '{:.0f}')} ms for the tiny"),
        (perf, f"at 0.47B: {spread(store, '{:.2f}')} s a version"),
        (perf, f"{spread(runs['runs']['sync_0.5b']['step_s'], '{:.0f}')} s a step, bubble ratio "
               f"{spread([s['rollout/bubble_ratio'] for s in sync], '{:.2f}')}"),
        (perf, "CUDA IPC run of the same model peaked at "
               f"{runs['runs']['publish_cuda_ipc']['peak_gpu_memory_mib'] / 1024:.0f} GiB"),
        (perf, f"decoded at {spread(before_fix, '{:.0f}')} ms a token**"),
        (design, f"but {spread(before_fix, '{:.0f}')} ms a token inside a run"),
    ]


def test_the_lora_figures_in_the_design_are_its_results_file():
    """docs/design.md "LoRA": LoRA beside full fine-tuning on the CPU, each figure from lora_vs_full_cpu.json."""
    import json

    j = json.loads((ROOT / "benchmarks" / "results" / "lora_vs_full_cpu.json").read_text())
    full, lora, ratio, mib = j["memory"]["full"], j["memory"]["lora"], j["full_over_lora"], 2 ** 20
    phrase = (f"the same {full['all_parameters'] / 1e6:.0f}M-parameter Qwen2 of the bench presets' width and the same "
              f"batches, rank {j['lora']['rank']} on every projection) LoRA trains "
              f"{lora['trainable_parameters'] / 1e6:.2f}M parameters, holds {ratio['optimizer_state_bytes']:.0f}x less "
              f"optimizer state ({lora['optimizer_state_bytes'] / mib:.1f} against "
              f"{full['optimizer_state_bytes'] / mib:.0f} MiB), uses {ratio['trainer_peak']:.1f}x less memory at its "
              f"peak beyond the process's imports ({lora['trainer_peak_mib']:.0f} against "
              f"{full['trainer_peak_mib']:.0f} MiB of RSS) and takes {ratio['step_cpu_time']:.1f}x less CPU time a "
              f"step ({ratio['step_wall_time']:.1f}x wall; medians of {j['settings']['rounds']} interleaved rounds)")
    assert phrase in " ".join(DESIGN.read_text().split())


def test_every_gpu_figure_in_the_docs_is_the_results_files():
    """The figures of docs/performance.md's "Measured on an H100", docs/verified.md, docs/running.md and
    docs/design.md, each rebuilt from benchmarks/results/gpu_*.json: a figure edited by hand, or a results file
    changed, fails here."""
    for document, phrase in gpu_figures():
        text = " ".join((ROOT / document).read_text().split())  # a phrase may wrap
        assert phrase in text, f"{document} does not say {phrase!r} (what benchmarks/results/gpu_*.json give)"
