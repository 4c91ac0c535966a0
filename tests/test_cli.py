"""Console scripts: one CLI style (tyro over a frozen config dataclass) for serve, proxy and the launchers.

The entry points are read from pyproject.toml's ``[project.scripts]`` and loaded the way the installed wrapper
does (``importlib.metadata.EntryPoint.load()``, then called with no arguments and ``sys.argv`` set), so no
``pip install`` is needed; ``python -m`` of each module is run in a subprocess.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import tyro

from rlcore import launch, proxy, replay, serve
from rlcore.launch import cli as launch_cli
from rlcore.launch import ray_cluster as ray_launch
from rlcore.training import online

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {})

# console script -> (python -m module, its config dataclass, flags its --help must show)
COMMANDS = {
    "rlcore-serve": ("rlcore.serve", serve.ServeConfig, ["--model", "--port", "--tool-parser", "--max-batch"]),
    "rlcore-proxy": ("rlcore.proxy", proxy.Args, ["--engine", "--model", "--admin-key", "--template-mode"]),
    "rlcore-launch": (
        "rlcore.launch",
        launch_cli.LaunchArgs,
        ["--alloc", "--model", "--setup-timeout", "--slurm", "--ray", "--address", "-- SCRIPT [FLAGS]"],
    ),
    "rlcore-ray-launch": (
        "rlcore.launch.ray_cluster",
        ray_launch.RayArgs,
        ["--alloc", "--model", "--address", "--strategy", "--num-cpus", "-- SCRIPT [FLAGS]"],
    ),
    "rlcore-replay": ("rlcore.replay", replay.ReplayArgs, ["DIR", "--objective", "--threads"]),
    "rlcore-online": ("rlcore.online", online.OnlineConfig, ["--model", "--db", "--admin-key", "--batch-sessions"]),
}
SUBCOMMAND = {"rlcore-online": ["serve"]}  # commands whose flags belong to a subcommand


def _flags(cls: type) -> list[str]:
    """Every option flag tyro derives from ``cls`` (kebab-case field names; the positional command aside)."""
    return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(cls)
            if f.name != "cmd" and "Positional" not in str(f.type)]


def test_pyproject_declares_every_console_script():
    assert set(SCRIPTS) == set(COMMANDS), SCRIPTS


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_console_script_help(name, monkeypatch, capsys):
    """The installed wrapper's call: ``load()()`` with ``sys.argv = [name, '--help']`` exits 0 and lists every
    field of the config as a flag, with its docstring."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(sys, "argv", [name, *SUBCOMMAND.get(name, []), "--help"])
    target = EntryPoint(name=name, value=SCRIPTS[name], group="console_scripts").load()
    with pytest.raises(SystemExit) as e:
        target()
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    _, cls, key_flags = COMMANDS[name]
    assert name in out  # usage names the command itself
    for flag in key_flags + _flags(cls):
        assert flag in out, (name, flag)
    first_doc_words = {
        "rlcore-serve": "Local HF model directory",
        "rlcore-proxy": "Comma-separated engine addresses",
        "rlcore-launch": "Print an sbatch script",
        "rlcore-ray-launch": "Placement-group strategy",
        "rlcore-replay": "Record directory written by",
        "rlcore-online": "Policy: 'countdown-tiny'",
    }[name]
    assert first_doc_words in out


def test_python_m_help_in_subprocesses():
    """``python -m <module> --help`` still works for every command and shows the same flags."""
    for name, (module, _, key_flags) in COMMANDS.items():
        res = subprocess.run(
            [sys.executable, "-m", module, *SUBCOMMAND.get(name, []), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**__import__("os").environ, "COLUMNS": "200"},
        )  # fmt: skip
        assert res.returncode == 0, (module, res.stderr[-2000:])
        for flag in key_flags:
            assert flag in res.stdout, (module, flag)


def test_launch_passes_the_trainer_command_verbatim(monkeypatch):
    """Everything after the first ``--`` reaches torchrun unchanged, the trainer's own ``--model``, ``--help``
    and ``--`` included; the launcher's flags go to the launcher."""
    seen = {}

    def fake_launch(alloc, cmd, **kw):
        seen.update(alloc=alloc, cmd=tuple(cmd), **kw)
        return 3

    monkeypatch.setattr(launch, "launch", fake_launch)
    tail = ["e.py", "grpo", "--model", "/other", "--help", "--", "x"]
    argv = ["--alloc", "engines:2+trainer:1", "--model", "/m", "--setup-timeout", "7", "--host", "0.0.0.0"]
    assert launch_cli.main([*argv, "--", *tail]) == 3
    assert seen["cmd"] == tuple(tail) and seen["model"] == "/m"
    assert (seen["alloc"].engines, seen["alloc"].trainer) == (2, 1)
    assert (seen["setup_timeout_s"], seen["host"], seen["engine"]) == (7.0, "0.0.0.0", "embedded")
    launch_cli.main(["--alloc", "engines:1+trainer:1", "--model", "/m", "--", "e.py"])
    assert seen["host"] == "127.0.0.1"  # the default bind stays loopback


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--alloc", "engines:2", "--model", "/m", "--", "e.py"], "--alloc"),
        (["--alloc", "engines:1+trainer:1", "--model", "/m"], "after '--'"),
        (["--alloc", "engines:1+trainer:1", "--model", "/m", "--slurm", "--ray", "--", "e.py"], "--slurm and --ray"),
        (["--alloc", "engines:1+trainer:1", "--model", "/m", "--engine", "vllm", "--", "e.py"], "--engine"),
    ],
)
def test_launch_bad_input_exits_2_naming_the_flag(argv, needle, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("must not launch"))
    with pytest.raises(SystemExit) as e:
        launch_cli.main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert needle in " ".join((captured.out + captured.err).split())


def test_slurm_flags_reach_the_script(capsys):
    argv = ["--slurm", "--alloc", "engines:1+trainer:2", "--model", "/m", "--job-name", "j1", "--time-limit",
            "01:00:00", "--partition", "gpu", "--", "e.py", "--steps", "2"]  # fmt: skip
    assert launch_cli.main(argv) == 0
    out = capsys.readouterr().out
    for line in ("#SBATCH --job-name=j1", "#SBATCH --time=01:00:00", "#SBATCH --partition=gpu"):
        assert line in out
    assert out.rstrip().endswith("torchrun --standalone --nproc_per_node=2 e.py --steps 2")


def test_launcher_built_serve_command_lines_parse_as_serve_config():
    """The command lines the launchers build for ``rlcore.serve`` use the flags ServeConfig defines (a flag
    renamed in serve.py must be renamed in the launchers too)."""
    cmd = launch.engine_command("embedded", "/m", "127.0.0.1", 1234, 1, ("--device", "cpu", "--max-batch", "8"))
    assert cmd[1:3] == ["-m", "rlcore.serve"]
    cfg = tyro.cli(serve.ServeConfig, args=cmd[3:])
    assert (cfg.model, cfg.host, cfg.port, cfg.device, cfg.max_batch) == ("/m", "127.0.0.1", 1234, "cpu", 8)
    script = launch.slurm_script(launch.parse_allocation("engines:1+trainer:1"), ["e.py"], model="/m")
    line = next(ln for ln in script.splitlines() if "rlcore.serve" in ln)
    serve_argv = line.split("rlcore.serve", 1)[1].rstrip(" &").split()
    assert tyro.cli(serve.ServeConfig, args=serve_argv).host == "127.0.0.1"  # one node: loopback


def test_proxy_default_admin_key_matches_the_library():
    """rlcore.proxy repeats the default key so that --help imports no torch; the two must agree."""
    from rlcore.rollout.proxy import DEFAULT_ADMIN_KEY

    assert proxy.DEFAULT_ADMIN_KEY == DEFAULT_ADMIN_KEY
    assert proxy.Args(engine="e", model="m").admin_key == DEFAULT_ADMIN_KEY


def test_serve_flags_for_decode_attention_and_overlap_reach_the_engine_config():
    """``rlcore-serve --decode-attention ... --overlap-decode ...`` change the engine's settings (not just parse)."""
    import tyro

    from rlcore.serve import ServeConfig, engine_config

    base = engine_config(tyro.cli(ServeConfig, args=["--model", "m"]))
    assert (base.decode_attention, base.overlap_decode) == ("auto", "auto")
    cfg = engine_config(
        tyro.cli(ServeConfig, args=["--model", "m", "--decode-attention", "gather", "--overlap-decode", "off"])
    )
    assert (cfg.decode_attention, cfg.overlap_decode) == ("gather", False)
    assert engine_config(tyro.cli(ServeConfig, args=["--model", "m", "--overlap-decode", "on"])).overlap_decode is True


def test_serve_flag_for_fused_projections_reaches_the_engine_config():
    """``rlcore-serve --fused-projections {auto,on,off}`` sets ``EngineConfig.fused_projections``."""
    from rlcore.serve import ServeConfig, engine_config

    for flag, want in (("auto", "auto"), ("on", True), ("off", False)):
        cfg = engine_config(tyro.cli(ServeConfig, args=["--model", "m", "--fused-projections", flag]))
        assert cfg.fused_projections == want
    assert engine_config(tyro.cli(ServeConfig, args=["--model", "m"])).fused_projections == "auto"
    with pytest.raises(SystemExit):
        tyro.cli(ServeConfig, args=["--model", "m", "--fused-projections", "yes"])


def test_proxy_cli_passes_every_shared_flag_to_the_proxy_config():
    """rlcore-proxy's flags that are ProxyConfig fields all reach the ProxyConfig it builds (a flag left out of
    serve() would do nothing)."""
    import dataclasses
    import inspect

    from rlcore.rollout.proxy import ProxyConfig

    shared = {f.name for f in dataclasses.fields(proxy.Args)} & {f.name for f in dataclasses.fields(ProxyConfig)}
    assert {"admin_key", "max_body_bytes", "capacity_gating", "template_mode"} <= shared
    src = inspect.getsource(proxy.serve)
    missing = [n for n in sorted(shared) if f"{n}=args.{n}" not in src]
    assert not missing, missing


@pytest.mark.parametrize("flags,needle", [([], "--model='"), (["--tokenizer", "/no/such/tok"], "--tokenizer='")])
def test_serve_bad_model_or_tokenizer_dir_is_one_line_naming_the_flag(tmp_path, flags, needle):
    """``rlcore-serve --model`` with a typo'd directory: one line naming the flag and the fix, exit 1, before
    transformers is asked (which would answer with a hub 'Repo id must be in the form' traceback)."""
    model = str(tmp_path / "nope") if not flags else str(ROOT / "rlcore" / "assets" / "countdown-tiny")
    with pytest.raises(SystemExit) as e:
        serve.cli(["--model", model, "--port", "0", *flags])
    msg = str(e.value.code)
    assert msg.startswith("rlcore-serve: " + needle) and "save_pretrained" in msg


def test_proxy_bad_model_dir_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(proxy, "serve", lambda *a: pytest.fail("must not serve"))
    with pytest.raises(SystemExit) as e:
        proxy.main(["--engine", "http://127.0.0.1:1", "--model", str(tmp_path / "nope")])
    assert str(e.value.code).startswith("rlcore-proxy: --model='") and "tokenizer" in str(e.value.code)


def test_readme_and_quickstart_name_every_console_script():
    """The install's commands, as README.md, docs/quickstart.md and docs/index.md list them, are pyproject's
    console scripts."""
    for doc in ("README.md", "docs/quickstart.md", "docs/index.md"):
        text = (ROOT / doc).read_text()
        assert all(f"`{name}`" in text for name in SCRIPTS), (doc, [n for n in SCRIPTS if f"`{n}`" not in text])
