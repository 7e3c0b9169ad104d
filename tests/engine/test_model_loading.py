"""Loading models the way the rest of the ecosystem names them: hub ids through the local
Hugging Face cache, revisions, dtypes, custom code only when trusted, a replacement chat
template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading import model_loader
from engine.loading.model_loader import resolve_dtype, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    """A Hugging Face cache holding ``acme/tiny`` (the tiny test model) at main = COMMIT,
    with the hub unreachable (HF_HUB_OFFLINE=1)."""
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_loads_from_the_local_cache_offline(hub_cache, tiny_model_dir):
    source = resolve_model("acme/tiny")
    assert source.model_id == "acme/tiny"
    assert Path(source.directory).name == COMMIT
    engine = LLMEngine(EngineConfig(model="acme/tiny"))
    assert engine.info.model_id == "acme/tiny"
    local = LLMEngine(EngineConfig(model=str(tiny_model_dir)))
    ids = engine.tokenizer("Hello, my name is")["input_ids"]
    from tests.engine.test_engine import greedy, run_to_completion

    outs = [run_to_completion(e, {0: [("r", ids, greedy(6))]})["r"][0].token_ids
            for e in (engine, local)]
    assert outs[0] == outs[1]


def test_a_revision_names_a_commit_of_the_cached_repository(hub_cache):
    assert Path(resolve_model("acme/tiny", COMMIT).directory).name == COMMIT
    with pytest.raises(FileNotFoundError, match="acme/tiny@v9"):
        resolve_model("acme/tiny", "v9")


def test_a_hub_id_missing_offline_is_a_clear_error_naming_it(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"'acme/absent'.*HF_HUB_OFFLINE"):
        resolve_model("acme/absent")
    with pytest.raises(FileNotFoundError, match="not an HF model directory"):
        resolve_model("no-such-dir")


def test_a_gguf_repository_snapshot_serves_its_one_gguf(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    snap = tmp_path / "hub" / "models--acme--tiny-GGUF" / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model("acme/tiny-GGUF")
    assert source.gguf_file == "tiny.Q4_0.gguf" and source.model_id == "acme/tiny-GGUF"
    (snap / "tiny.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="2 .gguf files"):
        resolve_model("acme/tiny-GGUF")


def test_dtype_auto_is_float32_on_cpu_and_the_checkpoint_half_dtype_on_cuda(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, torch.bfloat16) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", cuda, torch.float16) == torch.float16
    assert resolve_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", cuda, torch.float32) == torch.bfloat16
    assert resolve_dtype("auto", cuda, None) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", cuda, torch.bfloat16) == torch.float16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8", cpu)


def test_the_checkpoint_dtype_is_read_from_its_config(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    assert model_loader.config_dtype(resolve_model(str(d))) == torch.bfloat16


def test_a_model_with_its_own_code_is_refused_unless_trusted(tiny_model_dir, tmp_path):
    d = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "acme_custom"
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="--trust-remote-code"):
        LLMEngine(EngineConfig(model=str(d)))


def test_a_chat_template_file_replaces_the_models(tiny_model_dir, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}"
                        "{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}")
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), chat_template=str(template)))
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                tokenize=False, add_generation_prompt=True)
    assert text == "<<user>>hi<<assistant>>"
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), chat_template=str(tmp_path / "x")))
