"""`--speculative-config`: vLLM's field names, defaults and every refusal naming its field; the
flag in `atom serve`/`atom generate` argument parsing and in `LLM(speculative_config=...)`; the
engine settings and models a method cannot serve refused by name."""

from __future__ import annotations

import argparse
import json

import pytest

from atom_runtime.config import EngineConfig
from atom_runtime.engine_args import add_engine_arguments
from atom_runtime.spec_decode.config import SpeculativeConfig


def test_ngram_takes_vllms_defaults_and_one_bound_sets_the_other():
    spec = SpeculativeConfig.from_cli('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 4)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    assert spec.lookahead == 0  # no drafting model, no KV past the verified tokens
    one = SpeculativeConfig.from_cli(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)


def test_draft_model_is_inferred_from_model_and_reserves_lookahead():
    spec = SpeculativeConfig.from_cli({"model": "/m", "num_speculative_tokens": 3})
    assert spec.method == "draft_model" and spec.model == "/m"
    assert spec.lookahead == 3 and spec.draft_tensor_parallel_size == 1
    assert SpeculativeConfig.from_cli({"method": "qwen3_next_mtp", "num_speculative_tokens": 1})\
        .method == "mtp"  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ("not json", "speculative_config: not valid JSON"),
        ("[1]", "speculative_config: must be a JSON object"),
        ({"num_speculative_tokens": 2}, "speculative_config.method: required"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "speculative_config.method: eagle3"),
        ({"method": "lookup", "num_speculative_tokens": 2}, "speculative_config.method: unknown"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens: required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "m"}, "speculative_config.model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min",
        ),
        ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
         "speculative_config.prompt_lookup_max: only the ngram method"),
        (
            {"model": "m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "speculative_config.draft_tensor_parallel_size",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4},
            "speculative_config.disable_by_batch_size",
        ),
    ],
)  # fmt: skip
def test_bad_config_is_refused_naming_the_field(raw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpeculativeConfig.from_cli(raw if isinstance(raw, str) else json.dumps(raw))


def test_the_flag_parses_into_the_engine_config_and_llm_takes_a_dict():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    text = '{"method": "ngram", "num_speculative_tokens": 3}'
    config = EngineConfig.from_args(parser.parse_args(["--speculative-config", text]))
    assert config.speculative().num_speculative_tokens == 3
    from_dict = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert isinstance(from_dict.speculative_config, str)  # JSON, as the engine process gets it
    assert from_dict.speculative() == config.speculative()
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        EngineConfig(speculative_config='{"method": "ngram"}')


def test_every_method_takes_async_scheduling_and_tensor_parallelism():
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    # Speculating sequences sit out the steps launched while theirs is in flight
    # (tests/runtime/spec_decode/test_spec_async.py).
    for spec in (ngram, {"model": "/m", "num_speculative_tokens": 2},
                 {"method": "mtp", "num_speculative_tokens": 2}):  # fmt: skip
        assert EngineConfig(speculative_config=spec, async_scheduling=True).async_scheduling
    EngineConfig(speculative_config=ngram, tensor_parallel_size=2)  # host-only drafts
    # A drafting model runs whole on rank 0 (tests/runtime/spec_decode/test_spec_tp.py).
    for spec in ({"model": "/m", "num_speculative_tokens": 2},
                 {"method": "mtp", "num_speculative_tokens": 2}):  # fmt: skip
        EngineConfig(speculative_config=spec, tensor_parallel_size=2)


def test_methods_the_model_cannot_serve_are_refused_by_name(tiny_models, tmp_path):
    from atom_runtime import LLM
    from tests.model_factory import make_tiny_model

    with pytest.raises(ValueError, match="speculative_config.method: mtp needs a model whose"):
        LLM(str(tiny_models["llama"]), dtype="float32", num_gpu_blocks_override=16,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})  # fmt: skip
    # A draft of another vocabulary cannot propose the target's tokens.
    other = make_tiny_model(tmp_path / "other", "qwen2")
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary"):
        LLM(str(tiny_models["llama"]), dtype="float32", num_gpu_blocks_override=16,
            speculative_config={"model": str(other), "num_speculative_tokens": 2})  # fmt: skip


@pytest.mark.parametrize(
    "flag, says",
    [
        ("{bad", "speculative_config: not valid JSON"),
        ('{"method": "eagle3", "num_speculative_tokens": 2}', "speculative_config.method: eagle3"),
        ('{"method": "ngram"}', "speculative_config.num_speculative_tokens: required"),
        ('{"method": "mtp", "num_speculative_tokens": 2}', "speculative_config.method: mtp needs"),
        ('{"model": "/no/such/draft", "num_speculative_tokens": 2}',
         "speculative_config.model: model '/no/such/draft': no such file"),
    ],
)  # fmt: skip
def test_atom_serve_refuses_a_bad_speculative_config_in_one_line(tiny_models, flag, says):
    """A config the flag or the model (read from config.json only: no weights, no engine)
    refuses: exit status 2 and one line naming the field, before the server starts."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nothing listens on, should the refusal ever not come
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "atom_runtime", "serve", str(tiny_models["llama"]),
         "--port", str(port), "--speculative-config", flag],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atom serve: error: ")
    assert says in lines[0]
