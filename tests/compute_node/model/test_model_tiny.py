"""The tiny model builder: a directory transformers accepts (config, weights, tokenizer with
BOS/EOS and a chat template), deterministic per seed, single or sharded, and its CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tokenizers import Tokenizer

from compute_node.model.tiny import CHAT_TEMPLATE, build_tiny_model, count_parameters, main, train_tokenizer

TEXT = "The weather in the mountains is hard to predict, and walkers carry a warm coat."


def test_tokenizer_loads_in_transformers_with_specials_and_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path / "m", "qwen3", num_layers=1, hidden_size=64, num_heads=2,
                                 num_kv_heads=1, head_dim=32, intermediate_size=64, vocab_size=700)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 700
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == 0 and len(ids) < len(TEXT) / 2   # BOS, and merges learned from English text
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, tok.convert_tokens_to_ids("<|im_end|>")]
    # Every id the model can emit decodes (reserved specials pad the vocabulary).
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert raw.get_vocab_size() == 700 and raw.id_to_token(699) is not None


def test_small_vocabulary_is_padded_and_too_small_rejected() -> None:
    assert train_tokenizer(300).get_vocab_size() == 300
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model("/nonexistent", vocab_size=200)


def test_weights_are_deterministic_and_sharding_keeps_every_tensor(tmp_path: Path) -> None:
    spec = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "intermediate_size": 96, "vocab_size": 300}
    a = load_file(build_tiny_model(tmp_path / "a", "qwen2", seed=3, **spec) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", "qwen2", seed=3, **spec) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", "qwen2", seed=4, **spec) / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert not a["model.embed_tokens.weight"].equal(c["model.embed_tokens.weight"])
    assert "model.layers.1.self_attn.k_proj.bias" in a and "lm_head.weight" in a
    sharded = build_tiny_model(tmp_path / "s", "qwen2", seed=3, sharded=True, num_shards=2, **spec)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(a) and len(set(index["weight_map"].values())) == 2
    merged = {k: v for f in sorted(sharded.glob("model-*.safetensors")) for k, v in load_file(f).items()}
    assert all(merged[k].equal(a[k]) for k in a)
    assert count_parameters(sharded) == sum(t.numel() for t in a.values())


def test_cli_writes_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(tmp_path / "cli"), "--arch", "llama", "--num-layers", "1", "--hidden-size", "64", "--num-heads", "2",
          "--num-kv-heads", "2", "--head-dim", "32", "--intermediate-size", "64", "--vocab-size", "400",
          "--tie-word-embeddings", "--dtype", "bfloat16"])
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert "parameters" in capsys.readouterr().out
