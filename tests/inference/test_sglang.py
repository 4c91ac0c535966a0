"""SGLang launcher: flag generation and process handling with a fake server executable.

A real SGLang server is never started here (no GPU, no sglang package); the fake executable records
its argv/env and serves /health like SGLang does.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.inference.sglang import SGLangConfig, build_command, launch_sglang, to_flags

FAKE = textwrap.dedent(
    """
    import http.server, json, os, subprocess, sys, time
    mode, record = sys.argv[1], sys.argv[2]
    port = int(sys.argv[sys.argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # same process group
    json.dump({"argv": sys.argv, "triton": os.environ.get("TRITON_CACHE_PATH"), "pid": os.getpid(),
               "child": child.pid}, open(record, "w"))
    if mode == "die":
        sys.exit(3)
    if mode == "hang":
        time.sleep(60)
    time.sleep(0.3)  # slow start: /health unreachable at first
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_command_matches_spec_flags():
    cfg = SGLangConfig(model_path="/m", tp_size=2, random_seed=10)
    cmd = build_command(cfg, host="127.0.0.1", port=30000, base_gpu_id=4, server_index=3, python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    line = " ".join(cmd)
    head = ("--model-path /m --tokenizer-path /m --tokenizer-mode auto --trust-remote-code --tp-size 2 "
            "--base-gpu-id 4 --nnodes 1 --node-rank 0 --host 127.0.0.1 --port 30000 --random-seed 13")
    assert head in line
    for part in ["--skip-tokenizer-init", "--disable-radix-cache", "--attention-backend fa3", "--context-length 32768",
                 "--mem-fraction-static 0.9", "--chunked-prefill-size -1", "--max-prefill-tokens 32768",
                 "--schedule-policy lpm", "--schedule-conservativeness 1.0", "--dtype bfloat16",
                 "--kv-cache-dtype auto", "--dp-size 1", "--ep-size 1", "--load-format auto",
                 "--max-loaded-loras 8", "--lora-backend triton", "--log-level warning", "--log-level-http warning",
                 "--enable-metrics", "--decode-log-interval 1", "--cpu-offload-gb 0",
                 "--triton-attention-num-kv-splits 8", "--num-continuous-decode-steps 1", "--torch-compile-max-bs 32"]:
        assert f" {part} " in line + " ", part
    for absent in ["--pp-size", "--dist-init-addr", "--enable-lora", "--lora-paths", "--max-running-requests",
                   "--setup-timeout", "--launch-module", "--extra-args"]:
        assert absent not in line
    cfg = SGLangConfig(model_path="/m", pp_size=2, enable_lora=True, lora_paths=("a-v0=/a", "b-v0=/b"),
                       max_running_requests=64, skip_tokenizer_init=False, extra_args=("--foo",))
    cmd = build_command(cfg, host="h", port=1, dist_init_addr="h:2")
    line = " ".join(cmd)
    assert "--pp-size 2" in line and "--dist-init-addr h:2" in line and "--enable-lora" in line
    assert "--lora-paths a-v0=/a b-v0=/b" in line and "--max-running-requests 64" in line
    assert "--skip-tokenizer-init" not in line and cmd[-1] == "--foo"
    with pytest.raises(ValueError, match="model_path"):
        build_command(SGLangConfig(), host="h", port=1)


@given(st.dictionaries(st.from_regex(r"[a-z]{1,5}(_[a-z]{1,5}){0,2}", fullmatch=True),
                       st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text("ab", max_size=2),
                                 st.lists(st.integers(0, 9), max_size=3)), max_size=6))
def test_to_flags_rule(values):
    flags = to_flags(values)
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        omitted = value is None or value is False or value == "" or value == []
        assert (flag in flags) != omitted
        if not omitted and value is not True:
            i = flags.index(flag)
            want = [str(v) for v in value] if isinstance(value, list) else [str(value)]
            assert flags[i + 1:i + 1 + len(want)] == want
    assert all(not f.startswith("--") or "_" not in f for f in flags)


def run_fake(tmp_path, mode: str, **cfg_kw):
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE)
    record = tmp_path / "record.json"
    cfg = SGLangConfig(model_path="/m", health_poll_s=0.05, **cfg_kw)
    port = free_port()
    argv = [sys.executable, str(script), mode, str(record), "--port", str(port)]
    return cfg, port, argv, record


def test_launch_waits_for_health_and_kills_process_group(tmp_path):
    cfg, port, argv, record = run_fake(tmp_path, "ok", setup_timeout_s=20)
    t0 = time.monotonic()
    with launch_sglang(cfg, gpu=0, port=port, command=argv) as server:
        assert time.monotonic() - t0 >= 0.3
        assert server.url == f"http://127.0.0.1:{port}" and server.process.poll() is None
        rec = json.loads(record.read_text())
        assert rec["triton"] and os.path.isdir(rec["triton"]) and f"-{port}-" in rec["triton"]
        assert alive(rec["child"])
    assert server.process.poll() is not None
    deadline = time.monotonic() + 5
    while alive(rec["child"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(rec["child"])  # the whole group went down
    assert not os.path.exists(rec["triton"])


def test_launch_fails_fast_with_exit_code(tmp_path):
    cfg, port, argv, _ = run_fake(tmp_path, "die", setup_timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 3"):
        with launch_sglang(cfg, gpu=0, port=port, command=argv):
            pass
    assert time.monotonic() - t0 < 10


def test_launch_times_out_and_cleans_up(tmp_path):
    cfg, port, argv, record = run_fake(tmp_path, "hang", setup_timeout_s=1.5)
    with pytest.raises(TimeoutError, match="setup_timeout_s"):
        with launch_sglang(cfg, gpu=0, port=port, command=argv):
            pass
    rec = json.loads(record.read_text())
    assert not alive(rec["pid"])

