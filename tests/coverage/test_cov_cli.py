"""The gems-coverage CLI, in process (plus one subprocess for the no-traceback promise)."""
import csv
import io
import json
import os
import subprocess
import sys

import pytest

from gems_coverage.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_trace_table_is_the_readme_command(capsys):
    rc, out, err = run(capsys, "trace", "meta-llama/Llama-2-7b")
    assert rc == 0
    assert "meta-llama/Llama-2-7b (full, 6.74B params)" in out
    assert "inference on meta, bfloat16" in out
    assert "coverage " in out and "compute ops" in out and "mm.default" in out and "gaps" in out
    assert "[gems-coverage]" in err and "[gems-coverage]" not in out   # progress on stderr only


def test_trace_json_markdown_csv_and_output_file(capsys, tmp_path):
    rc, out, _ = run(capsys, "trace", "bert", "--format", "json", "--seq-len", "16")
    d = json.loads(out)
    assert rc == 0 and d["model"] == "bert-base-uncased" and d["mode"] == "inference"
    assert {"distinct_ops", "compute_ops", "covered_compute_ops", "coverage_pct"} <= set(d["summary"])
    rc, out, _ = run(capsys, "trace", "bert", "--format", "markdown", "--seq-len", "16")
    assert rc == 0 and out.startswith("## bert-base-uncased") and "| op " in out
    rc, out, _ = run(capsys, "trace", "bert", "--format", "csv", "--seq-len", "16", "--mode", "training")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rc == 0 and rows and {"name", "calls", "covered", "category"} <= set(rows[0])
    assert all(r["mode"] == "training" for r in rows)
    f = tmp_path / "sub" / "t.json"
    # -o never creates a missing folder: bad input, found before the run
    rc, out, err = run(capsys, "trace", "aquila", "--format", "json", "--output", str(f), "--seq-len", "8")
    assert rc == 2 and "folder" in err and "does not exist" in err and "[gems-coverage]" not in err
    assert not f.parent.exists()
    f.parent.mkdir()
    rc, out, err = run(capsys, "trace", "aquila", "--format", "json", "--output", str(f), "--seq-len", "8")
    assert rc == 0 and out == "" and json.loads(f.read_text())["model"] == "BAAI/Aquila-7B"


def test_fail_under_gate(capsys):
    rc, out, err = run(capsys, "-q", "trace", "llama2", "--seq-len", "8", "--fail-under", "0")
    assert rc == 0
    rc, out, err = run(capsys, "-q", "trace", "llama2", "--seq-len", "8", "--format", "json")
    pct = json.loads(out)["summary"]["coverage_pct"]
    if pct < 100:
        rc, out, err = run(capsys, "-q", "trace", "llama2", "--seq-len", "8", "--fail-under", "100")
        assert rc == 1 and "below --fail-under 100%" in err and out


@pytest.mark.parametrize("argv,msg", [
    (["trace", "no-such-model"], "unknown model 'no-such-model'"),
    (["trace", "llama2", "--mode", "serve"], "invalid choice"),
    (["trace", "llama2", "--batch", "0"], "positive integer"),
    (["trace", "llama2", "--dtype", "float13"], "unknown dtype"),
    (["trace", "llama2", "--device", "tpu"], "unknown device"),
    (["trace", "llama2", "--fail-under", "150"], "between 0 and 100"),
    (["trace", "bert", "--mode", "generate"], "needs a causal LM"),
    (["trace", "llama2", "--gems"], "cannot enable Gems for device meta"),
    (["report", "llama2", "--modes", "inference,serve"], "unknown mode 'serve'"),
    (["report", "nope"], "unknown model"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
    (["trace", "bert", "--new-tokens", "3"], "--new-tokens applies to --mode generate only"),
    (["trace", "llama2", "--mode", "training", "--new-tokens", "3"], "--new-tokens applies to --mode generate"),
    (["report", "llama2", "--new-tokens", "3"], "--new-tokens applies to --modes with generate"),
    (["report", "bert", "--modes", "generate"], "--modes generate needs a causal LM"),
    (["parity", "llama2", "--mode", "training", "--new-tokens", "3"], "--new-tokens applies to --mode inference"),
    (["bench", "llama2", "--new-tokens", "3"], "--new-tokens applies to --workload decode"),
    (["ops", "--category", "nonsense"], "unknown category 'nonsense' (pointwise,"),
    (["roadmap", "--root", "/no/such/folder", "--no-record"], "--root /no/such/folder: no such folder"),
    (["trace", "bert", "-o", "/no/such/folder/x.txt"], "folder /no/such/folder does not exist"),
    (["trace", "bert", "--seq-len", "1000"], "bert-base-uncased (full) takes at most 512 positions"),
    (["trace", "llama2", "--device", "cpu", "--seq-len", "300"], "(tiny) takes at most 256 positions"),
    (["trace", "llama2", "--mode", "generate", "--seq-len", "4090", "--new-tokens", "10"],
     "--seq-len 4090 + 9 generated = 4099"),
    (["trace", "llama2", "--sample"], "--sample applies to --mode generate only"),
    (["trace", "llama2", "--mode", "generate", "--top-k", "5"], "--top-k applies with --sample only"),
    (["trace", "llama2", "--mode", "generate", "--temperature", "0.5"], "--temperature applies with --sample only"),
    (["trace", "llama2", "--mode", "generate", "--sample", "--top-p", "1.5"], "expected a number in (0, 1]"),
    (["trace", "llama2", "--mode", "generate", "--sample", "--top-p", "0"], "expected a number in (0, 1]"),
    (["trace", "llama2", "--mode", "generate", "--sample", "--temperature", "0"], "expected a positive number"),
    (["trace", "llama2", "--mode", "generate", "--sample", "--top-k", "-1"], "non-negative integer"),
    (["report", "llama2", "--sample"], "--sample applies to --modes with generate only"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, msg):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    lines = [ln for ln in err.splitlines() if not ln.startswith("[gems-coverage]")]
    assert len(lines) == 1 and lines[0].startswith("gems-coverage: error:") and msg in lines[0]
    assert "Traceback" not in err


def test_malformed_config_exits_2(capsys, tmp_path):
    f = tmp_path / "config.json"
    f.write_text('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5')
    rc, out, err = run(capsys, "trace", str(f))
    assert rc == 2 and "malformed config JSON" in err and len(err.strip().splitlines()) == 1


def test_local_config_folder(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 500}))
    rc, out, err = run(capsys, "-q", "trace", str(tmp_path), "--format", "json", "--mode", "training")
    d = json.loads(out)
    assert rc == 0 and d["model_source"] == "config" and d["summary"]["compute_ops"] > 10


def test_report_matrix(capsys):
    rc, out, err = run(capsys, "-q", "report", "bert", "aquila", "--seq-len", "8", "--format", "json")
    m = json.loads(out)
    assert rc == 0 and len(m["per_model"]) == 4   # 2 models x inference, training
    assert m["columns"][0] == "bert-base-uncased|inference"
    ops = {e["name"]: e for e in m["ops"]}
    assert "silu.default" in ops and "bert-base-uncased|inference" not in ops["silu.default"]["calls"]
    assert ops["mm.default"]["calls"]["BAAI/Aquila-7B|training"] > 0
    rc, out, err = run(capsys, "-q", "report", "bert", "--seq-len", "8", "--format", "markdown")
    assert rc == 0 and "# Gems coverage of bert\n" in out and "| op " in out
    rc, out, err = run(capsys, "-q", "report", "bert", "--seq-len", "8")
    assert rc == 0 and "overall:" in out


def test_encoder_decoder_config_is_bad_input(capsys, tmp_path):
    f = tmp_path / "t5.json"
    f.write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": 256,
                             "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
                             "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}))
    for argv in (["trace", str(f)], ["trace", str(f), "--device", "cpu"], ["parity", str(f)]):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and "encoder-decoder models (t5) are not supported" in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "[gems-coverage]" not in err


def test_too_large_for_memory_is_refused_before_building(capsys, monkeypatch):
    """--size full on CPU: the OOM killer would end the run after minutes without a word."""
    from gems_coverage import runner
    monkeypatch.setattr(runner, "available_memory", lambda device: (8 * 1024 ** 3, "MemAvailable"))
    from harness import DEVICE
    for argv in (["parity", "llama2", "--size", "full", "--device", DEVICE],
                 ["trace", "llama2", "--device", "cpu", "--size", "full"]):
        rc, out, err = run(capsys, *argv)
        assert rc == 2, (argv, err)
        assert "6.74B parameters) needs about" in err and "8.0 GiB is available (MemAvailable)" in err, err
        assert "--size tiny" in err and "building" not in err


def test_registered_count_is_the_backends(capsys):
    """The header's count is what the active backend registers (the registry is the only source)."""
    import gems
    n = len(gems.registered_ops())
    rc, out, err = run(capsys, "-q", "trace", "bert", "--seq-len", "8")
    assert rc == 0 and f"gems    {n} registered overloads on backend '{gems.backend().name}'" in out
    rc, out, err = run(capsys, "-q", "trace", "bert", "--seq-len", "8", "--format", "json")
    assert json.loads(out)["gems"]["registered_ops"] == n


def test_quiet_after_the_subcommand_silences_stderr():
    """-q before or after the subcommand: no progress, no warnings, no profiler lines (fd 2 included)."""
    model = "bert"
    for argv in (["-q", "trace", model], ["trace", model, "-q"]):
        p = subprocess.run([sys.executable, "-m", "gems_coverage.cli", *argv, "--device", "cpu", "--seq-len", "8"],
                           capture_output=True, text=True, env=dict(os.environ), timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stderr == "", p.stderr[-2000:]
        assert "coverage " in p.stdout
    # without -q the profiler run is visible: the test above is not vacuous
    p = subprocess.run([sys.executable, "-m", "gems_coverage.cli", "trace", model, "--device", "cpu", "--seq-len", "8"],
                       capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert p.returncode == 0 and "[gems-coverage]" in p.stderr


def test_ops_command(capsys):
    import gems
    rc, out, err = run(capsys, "ops", "--format", "json")
    d = json.loads(out)
    assert rc == 0 and d["registered_ops"] == len(gems.registered_ops()) == len(d["ops"])
    assert all({"name", "category", "dtypes", "backward"} <= set(o) for o in d["ops"])
    rc, out, err = run(capsys, "ops")
    assert rc == 0 and "overload" in out and "category" in out


def test_subprocess_unknown_model_no_traceback():
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "gems_coverage.cli", "trace", "llama3-405b"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().startswith("gems-coverage: error: unknown model 'llama3-405b'")
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr and p.stdout == ""


def test_module_function_from_the_current_folder(tmp_path):
    """The console script (unlike `python -m`) has no current folder on sys.path: a module:function model's
    module that is found nowhere else is imported from the current folder, so `gems-coverage trace
    mymodels:build` works from the folder that holds mymodels.py."""
    import shutil
    exe = shutil.which("gems-coverage") or str(__import__("pathlib").Path(sys.executable).with_name("gems-coverage"))
    if not os.path.exists(exe):
        pytest.skip("the gems-coverage console script is not installed")
    (tmp_path / "cov_cli_models.py").write_text(
        "import torch\n"
        "def mlp(device='cpu', dtype=torch.float32):\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())\n"
        "    return m.to(device=device, dtype=dtype), (torch.randn(2, 8, device=device, dtype=dtype),)\n")
    p = subprocess.run([exe, "-q", "trace", "cov_cli_models:mlp", "--format", "json"], cwd=tmp_path,
                       capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["model"] == "cov_cli_models:mlp"


def test_a_folder_named_gems_in_the_current_folder_does_not_shadow_gems(tmp_path):
    """Run from the folder that holds a clone named `gems` (what `git clone` makes), the CLI must still load
    the installed Gems: nothing puts the current folder on sys.path, where `./gems/` would import as an
    empty namespace package. Run as the console script runs it: the script's folder, not the current
    folder, is sys.path[0]."""
    import gems
    (tmp_path / "gems").mkdir()
    script = "import sys; sys.path.pop(0); from gems_coverage.cli import main; sys.exit(main())"
    for argv in (["--help"], ["ops", "--format", "json"]):
        p = subprocess.run([sys.executable, "-c", script, *argv], cwd=tmp_path, capture_output=True, text=True,
                           env=dict(os.environ), timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["backend"] == gems.backend().name and d["registered_ops"] == len(gems.registered_ops())


def test_trace_generate_sampling_options(capsys):
    # --sample with its knobs reaches the runner: the trace's note says what ran, and top-k / top-p
    # add their ops (topk; sort, cumsum, scatter) next to multinomial
    rc, out, err = run(capsys, "-q", "trace", "llama2", "--mode", "generate", "--seq-len", "8", "--new-tokens", "2",
                       "--sample", "--temperature", "0.5", "--top-k", "7", "--top-p", "0.8", "--format", "json")
    d = json.loads(out)
    names = {o["name"] for o in d["ops"]}
    assert rc == 0 and "generate: sampling (temperature 0.5, top_k 7, top_p 0.8" in " ".join(d["notes"])
    assert {"multinomial.default", "topk.default", "sort.default", "cumsum.default", "scatter.src"} <= names
    assert "argmax.default" not in names
    # knobs that switch a warper off leave its ops out (as generate() leaves the warper out)
    rc, out, err = run(capsys, "-q", "trace", "llama2", "--mode", "generate", "--seq-len", "8", "--new-tokens", "2",
                       "--sample", "--top-k", "0", "--top-p", "1", "--format", "json")
    names = {o["name"] for o in json.loads(out)["ops"]}
    assert rc == 0 and "multinomial.default" in names and not names & {"topk.default", "sort.default"}
    rc, out, err = run(capsys, "-q", "trace", "llama2", "--mode", "generate", "--seq-len", "8", "--format", "json")
    d = json.loads(out)
    assert "generate: greedy (argmax)" in d["notes"] and "argmax.default" in {o["name"] for o in d["ops"]}


def _gpt2_config(tmp_path):
    f = tmp_path / "gpt2.json"
    f.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256,
                             "n_positions": 64, "n_embd": 96, "n_layer": 3, "n_head": 4}))
    return str(f)


def test_report_header_names_the_command_and_models_that_ran(capsys, tmp_path):
    """A report of the user's own model says which command made it and of which models, not the
    checked-in page's fixed command and "the supported models"."""
    f = _gpt2_config(tmp_path)
    rc, out, err = run(capsys, "-q", "report", f, "--modes", "inference", "--seq-len", "8", "--format", "markdown")
    head = out.split("| op ")[0]
    assert rc == 0 and f"# Gems coverage of {f}\n" in head, head
    assert f"Generated by `gems-coverage -q report {f} --modes inference --seq-len 8 --format markdown`" in head
    assert "docs/coverage.md" not in head and "supported models" not in head and "Aquila" not in head
    assert f"models: {f})" in head


def test_cpu_says_first_that_a_users_config_is_built_tiny(capsys, tmp_path):
    """--device cpu builds the tiny variant of a user's own config: the first line of the result (and of
    stderr) says so; a chosen --size says nothing."""
    f = _gpt2_config(tmp_path)
    rc, out, err = run(capsys, "trace", f, "--device", "cpu", "--no-profile", "--seq-len", "4")
    note = f"note: {f} is built as a tiny variant of its architecture on --device cpu"
    assert rc == 0 and out.splitlines()[0].startswith(note), out[:300]
    assert err.splitlines()[0].startswith(f"[gems-coverage] {note}"), err[:300]
    assert err.count("note:") == 1 and err.splitlines()[1].startswith("[gems-coverage] building"), err[:600]
    rc, out, err = run(capsys, "trace", f, "--device", "cpu", "--size", "tiny", "--no-profile", "--seq-len", "4")
    assert rc == 0 and "note:" not in out and "note:" not in err


def test_interpreter_runtime_warnings_are_ignored_for_that_module_only(monkeypatch):
    """Masked-off lanes of an interpreted kernel divide by zero in numpy: noise, ignored while a command
    runs on the interpreter; the same warning from anywhere else still shows."""
    import warnings
    from gems_coverage import cli
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with cli._interpreter_warnings():
            warnings.warn_explicit("divide by zero encountered in divide", RuntimeWarning, "interpreter.py", 490,
                                   module="triton.runtime.interpreter")
            warnings.warn_explicit("divide by zero encountered in divide", RuntimeWarning, "mine.py", 1,
                                   module="mine")
    assert [str(w.message) for w in seen] == ["divide by zero encountered in divide"]
    assert seen[0].filename == "mine.py"


def test_profiler_usdt_lines_are_not_printed(tmp_path):
    """torch.profiler's kineto prints "USDT: ... profiler_start/stop" on stderr for every profiled run."""
    f = _gpt2_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    p = subprocess.run([sys.executable, "-m", "gems_coverage.cli", "trace", f, "--device", "cpu", "--seq-len", "4"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "profiling" in p.stderr, p.stderr[-2000:]
    assert "USDT" not in p.stderr and "profiler_start" not in p.stderr, p.stderr[-2000:]


def test_the_tool_and_the_benchmarks_run_gems_kernels_from_the_first_call():
    # gems-coverage's parity and timed runs, and benchmarks/, must not let ATen answer a first call
    # while its kernel compiles (background compilation, the library's default): the variable is set
    # before gems reads it, unless the user set it
    code = ("import sys, {mod}; assert 'gems' not in sys.modules; {call}; "
            "from gems.runtime import settings; print(settings.BACKGROUND_COMPILE)")
    env = {k: v for k, v in os.environ.items() if k != "GEMS_COMPILE"}
    for mod, call in (("gems_coverage.cli", "gems_coverage.cli.main(['-q', 'ops', '--format', 'json'])"),
                      ("benchmarks", "None")):
        for value, want in ((None, "False"), ("background", "True")):
            e = env if value is None else dict(env, GEMS_COMPILE=value)
            p = subprocess.run([sys.executable, "-c", code.format(mod=mod, call=call)], env=e, capture_output=True,
                               text=True, timeout=300, cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
            assert p.stdout.strip().splitlines()[-1:] == [want], (mod, value, p.stderr[-1500:])
