import json
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlsys.models as models
from rlsys.config import Config, DataConfig, ModelConfig, WarmStartConfig
from rlsys.data.synthetic import make_split
from rlsys.models import (ModelDirError, cache_key, load_tokenizer, prepare_model, validate_model_dir,
                          weights_fingerprint)
from rlsys.models.tiny import build_char_tokenizer, build_tiny_model
from rlsys.models.warm_start import draw_batch, encode_examples, guess, near_miss, warm_start

from helpers import SMALL_MODEL as SMALL


def small_config(tmp_path, steps=3) -> Config:
    return Config(model=ModelConfig(**SMALL, cache_dir=str(tmp_path / "cache"),
                                    warm_start=WarmStartConfig(steps=steps, batch_size=8)),
                  data=DataConfig(train_size=40, eval_size=4))


def test_tokenizer_round_trips_one_token_per_character_after_save_and_load(tmp_path):
    build_char_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "rep 3 ab=ababab\nadd 12+7=19 ,:?*-"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, None)
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text
    assert tok.decode(tok("naïve €")["input_ids"]) == "naïve €"  # any text: bytes, not <unk>


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_is_a_standard_hf_dir(tmp_path, arch):
    model_dir = build_tiny_model(ModelConfig(arch=arch, **SMALL), tmp_path / "m", seed=0)
    assert validate_model_dir(model_dir) == model_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    assert model.config.model_type == arch and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == model.generation_config.pad_token_id == tok.pad_token_id
    logits = model(**tok(["rev ab="], return_tensors="pt")).logits
    assert logits.shape == (1, 7, len(tok))
    again = build_tiny_model(ModelConfig(arch=arch, **SMALL), tmp_path / "again", seed=0)
    first, second = load_file(model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)  # seeded


def test_warm_start_lowers_the_answer_loss_and_saves_an_hf_dir(tmp_path):
    model_dir = build_tiny_model(ModelConfig(**SMALL), tmp_path / "m")
    before = load_file(model_dir / "model.safetensors")
    train = make_split("synthetic", "train", 64, seed=0)
    threads = torch.get_num_threads()
    result = warm_start(model_dir, train, WarmStartConfig(steps=20, batch_size=16, lr=1e-2))
    assert result["loss_last"] < 0.8 * result["loss_first"], result
    after = load_file(model_dir / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert torch.get_num_threads() == threads  # its one-thread setting is undone
    assert AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size == 259


def test_prepare_model_builds_once_then_reuses_the_cache(tmp_path, monkeypatch):
    cfg = small_config(tmp_path)
    path = prepare_model(cfg)
    assert path.parent == tmp_path / "cache" and path.name == cache_key(cfg)
    info = json.loads((path / models.BUILD_INFO).read_text())
    assert info["warm_start"]["steps"] == 3 and 0 <= info["warm_start"]["eval_greedy_accuracy"] <= 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no temp dir left

    def no_rebuild(*_):
        raise AssertionError("the cached model was rebuilt")
    monkeypatch.setattr(models, "_build", no_rebuild)
    assert prepare_model(cfg) == path
    other = small_config(tmp_path, steps=4)
    assert cache_key(other) != cache_key(cfg)


def test_a_built_models_fingerprint_is_of_its_weights_and_a_users_model_has_none(tmp_path):
    path = prepare_model(small_config(tmp_path, steps=0))
    fingerprint = weights_fingerprint(path)
    assert re.fullmatch(r"[0-9a-f]{16}", fingerprint) and weights_fingerprint(path) == fingerprint
    user = tmp_path / "user"
    shutil.copytree(path, user)
    (user / models.BUILD_INFO).unlink()
    assert weights_fingerprint(user) is None  # its path names it
    weights = path / "model.safetensors"
    changed = bytearray(weights.read_bytes())
    changed[-1] ^= 1
    weights.write_bytes(bytes(changed))
    assert weights_fingerprint(path) != fingerprint


def test_a_failed_build_leaves_no_cache_entry(tmp_path, monkeypatch):
    def crash(cfg, out):
        (out / "config.json").write_text("{}")  # half written
        raise RuntimeError("killed mid-build")
    monkeypatch.setattr(models, "_build", crash)
    with pytest.raises(RuntimeError, match="mid-build"):
        prepare_model(small_config(tmp_path))
    assert list((tmp_path / "cache").iterdir()) == []


def test_model_path_is_validated_with_the_field_named(tmp_path):
    cfg = Config(model=ModelConfig(path=str(tmp_path / "absent")))
    with pytest.raises(ModelDirError, match="model.path: .*absent is not a directory"):
        prepare_model(cfg)
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text("{}")
    with pytest.raises(ModelDirError, match="model.path: .*partial lacks weights.*; tokenizer"):
        prepare_model(Config(model=ModelConfig(path=str(tmp_path / "partial"))))
    model_dir = build_tiny_model(ModelConfig(**SMALL), tmp_path / "ok")
    assert prepare_model(Config(model=ModelConfig(path=str(model_dir)))) == model_dir


def test_cache_key_covers_the_module_that_defines_the_task_family():
    """Editing a family's module must give a new warm-start cache entry, never a stale hit."""
    from rlsys.models import task_sources

    assert [p.name for p in task_sources("math")] == ["math_tasks.py"]
    assert [p.name for p in task_sources("code")] == ["code_tasks.py"]
    assert task_sources("synthetic") == [] and task_sources("rev") == []  # synthetic.py is always hashed


def test_near_miss_is_one_edit_away_and_never_the_answer():
    rng = random.Random(0)
    for answer in ["a", "ab", "392", "ababab", "zz"]:
        for _ in range(200):
            wrong = near_miss(answer, rng)
            assert wrong != answer
            assert abs(len(wrong) - len(answer)) <= 1
            if len(wrong) == len(answer):  # a replacement: exactly one position differs
                assert sum(a != b for a, b in zip(wrong, answer)) == 1


def test_label_noise_replaces_that_share_of_warm_start_answers(tmp_path):
    tok = build_char_tokenizer()
    prompts = make_split("synthetic", "train", 50, seed=0)
    examples, kept, dropped = encode_examples(tok, prompts, max_len=128)
    assert dropped == 0 and kept == prompts
    clean = {tuple(ids) for ids, _ in examples}
    rng = random.Random(1)
    cfg = WarmStartConfig(batch_size=2000, label_noise=0.3)
    batch = draw_batch(rng, examples, kept, cfg, tok)
    noisy = sum(tuple(ids) not in clean for ids, _ in batch) / len(batch)
    assert abs(noisy - 0.3) < 0.04, noisy
    assert all(ids[-1] == tok.eos_token_id for ids, _ in batch)
    quiet = draw_batch(random.Random(1), examples, kept, WarmStartConfig(batch_size=200), tok)
    assert all(tuple(ids) in clean for ids, _ in quiet)  # no noise: the clean examples only


def test_guess_noise_keeps_the_answers_shape_and_nothing_of_its_digits():
    """noise=guess: every direct answer replaced (label_noise=1) by characters of its kinds, each digit drawn
    uniformly whatever the answer's: unlike a near miss, a guess agrees with the answer at a digit 1 time in 10."""
    rng = random.Random(0)
    answers = [str(rng.randint(1000, 99999)) for _ in range(400)] + ["ab-12"]
    guesses = [guess(a, rng) for a in answers]
    assert all(len(g) == len(a) and all(x.isdigit() == y.isdigit() for x, y in zip(g, a))
               for g, a in zip(guesses, answers))
    assert guess("ab-12", random.Random(1))[2] == "-"
    digits = [(x, y) for g, a in zip(guesses, answers) for x, y in zip(g, a) if y.isdigit()]
    assert abs(sum(x == y for x, y in digits) / len(digits) - 0.1) < 0.03
    tok = build_char_tokenizer()
    prompts = make_split("synthetic", "train", 50, seed=0)
    examples, kept, _ = encode_examples(tok, prompts, max_len=128)
    cfg = WarmStartConfig(batch_size=500, label_noise=1.0, noise="guess")
    batch = draw_batch(random.Random(1), examples, kept, cfg, tok)
    clean = {tuple(ids) for ids, _ in examples}
    assert sum(tuple(ids) in clean for ids, _ in batch) < 0.1 * len(batch)  # a digit answer guessed right by chance


def test_the_builds_exact_match_generates_no_longer_than_the_longest_answer(tmp_path, monkeypatch):
    """The build measures greedy exact match at rollout.max_new_tokens (4096 for the GPU bench): past the
    longest answer and its EOS no sample can match, so generate is not asked for more."""
    from transformers import GenerationMixin

    from rlsys.models.warm_start import exact_match_accuracy

    model_dir = build_tiny_model(ModelConfig(**{**SMALL, "max_position_embeddings": 4224}), tmp_path / "m")
    prompts = make_split("synthetic", "eval", 6, seed=0)
    longest = max(len(p.answer) for p in prompts)  # one token per character
    generate, asked = GenerationMixin.generate, []

    def recording(self, *args, **kwargs):
        asked.append(kwargs["max_new_tokens"])
        return generate(self, *args, **kwargs)
    monkeypatch.setattr(GenerationMixin, "generate", recording)
    capped = exact_match_accuracy(model_dir, prompts, max_new_tokens=4096)
    assert asked == [longest + 1]
    assert exact_match_accuracy(model_dir, prompts, max_new_tokens=longest + 40) == capped


def test_no_warm_start_builds_the_model_without_fine_tune_or_greedy_eval(tmp_path, monkeypatch, capsys):
    from rlsys.models import warm_start as ws_module

    def never(*_, **__):
        raise AssertionError("a warm start or its eval ran with model.warm_start.steps=0")
    monkeypatch.setattr(ws_module, "warm_start", never)
    monkeypatch.setattr(ws_module, "exact_match_accuracy", never)
    path = prepare_model(small_config(tmp_path, steps=0))
    assert json.loads((path / models.BUILD_INFO).read_text())["warm_start"] == {"steps": 0}
    assert AutoModelForCausalLM.from_pretrained(path).config.vocab_size == 259
    assert "warm start: off" in capsys.readouterr().out


def test_a_warm_start_on_cuda_without_a_gpu_is_refused_naming_the_field(tmp_path):
    from rlsys.errors import UserError

    cfg = small_config(tmp_path)
    cfg.model.warm_start.device = "cuda"
    with pytest.raises(UserError, match=r"model.warm_start.device=cuda: .*sees no CUDA device.*device=cpu"):
        prepare_model(cfg)
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half built is kept


def test_micro_batches_hold_16_examples_or_4096_padded_tokens_in_order():
    from rlsys.models.warm_start import MICRO_TOKENS, micro_batches

    def examples(*lengths):
        return [([0] * n, [0] * n) for n in lengths]
    short = examples(*[50] * 40)  # the default tasks: in sixteens, as before
    assert [len(m) for m in micro_batches(short)] == [16, 16, 8]
    long = examples(100, 300, 1500, 2000, 2100, 5000)  # rep_long's tail: cut by padded tokens
    cut = micro_batches(long)
    assert [[len(e[0]) for e in m] for m in cut] == [[100, 300], [1500, 2000], [2100], [5000]]
    assert all(len(m) * max(len(e[0]) for e in m) <= MICRO_TOKENS or len(m) == 1 for m in cut)
