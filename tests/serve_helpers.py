"""Helpers for the `flashllm serve` tests: the real server in a subprocess on a free loopback
port, stopped with SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import sys
import time
from pathlib import Path

from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from flashllm.convert.convert import convert_source
from flashllm.generation.chat_template import CHATML
from tiny_sources import ArraySource, tiny_arrays, tiny_config

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "hello", "there",
         "how", "are", "you", "fine", "thanks", "a", "b", "c"]


def build_tiny(out: Path, dtype: str = "f32", **config) -> Path:
    """A converted tiny model with a word-level tokenizer over WORDS and ChatML; no end of text
    token, so an answer runs as long as it is let."""
    cfg = tiny_config(vocab_size=len(WORDS), eos_token_ids=(), context_length=4096, **config)
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in WORDS[1:3]])
    src = ArraySource(cfg, tiny_arrays(cfg, seed=5), tokenizer_json=hf.to_str(),
                      chat_template=CHATML)
    return convert_source(src, out, dtype)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `flashllm serve` process: url, the stderr log, stop()."""

    def __init__(self, model, *args: str, timeout: float = 300.0):
        import httpx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(tempfile.gettempdir()) / f"serve-{self.port}.log", "w+")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "flashllm", "serve", str(model),
                                      "--port", str(self.port), *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"serve did not answer in {timeout} s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
