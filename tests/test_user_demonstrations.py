"""A user's environment on the CPU: the tiny model calls only what its warm start demonstrated, so a task of the
user's own needs the user's demonstrations (model.warm_start.demonstrations), or the model never calls it."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys.config import ConfigError
from rlsys.models import cache_key, prepare_model
from rlsys.startup import load_config

VAULT = '''
import zlib

from rlsys.tools import CALL_CLOSE, CALL_OPEN, render_response


def code(game):
    return str(1000 + zlib.crc32(str(game).encode()) % 9000)


def vault(rng):
    game = rng.randint(100, 999)
    return f"vault {game}: ", code(game)


class Vault:
    """Tells the code of the prompt's vault to whoever asks `open`."""

    def reset(self, sample):
        self.answer = sample["answer"]

    def step(self, action):
        return (self.answer if action == "open" else "error: say open"), 0.0, False


def demonstrate(prompt):
    return [(f"{CALL_OPEN}open{CALL_CLOSE}", True), (render_response(prompt.answer), False), (prompt.answer, True)]


def two(prompt, other):
    return []
'''


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    path = tmp_path_factory.mktemp("vault") / "vault.py"
    path.write_text(VAULT)
    return path


def overrides(vault, tmp_path, *more):
    return [f"data.task={vault}:vault", f"tools.env={vault}:Vault", "data.train_size=64", "data.eval_size=8",
            "model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=128",
            f"model.cache_dir={tmp_path / 'cache'}", "model.warm_start.steps=150", "model.warm_start.batch_size=16",
            *more]


def calls(model_dir, prompts) -> int:
    """How many prompts the model's greedy answer opens with a call."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    n = 0
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id)
        n += tok.decode(out[0, ids.shape[1]:]).startswith("<tool_call>open")
    return n


def test_a_user_s_task_and_environment_are_called_only_with_the_user_s_demonstrations(vault, tmp_path):
    with pytest.raises(ConfigError, match=r"model.warm_start.tool_share: data.task=.*has no tool-use demonstrations.*"
                                          r"model.warm_start.demonstrations=module:function"):
        load_config(None, overrides(vault, tmp_path, "model.warm_start.tool_share=0.5"))
    with pytest.raises(ConfigError, match=r"model.warm_start.demonstrations: .*:two' has the signature \(prompt, "
                                          r"other\), but rlsys calls it as fn\(prompt\)"):
        load_config(None, overrides(vault, tmp_path, f"model.warm_start.demonstrations={vault}:two"))
    prompts = [f"vault {g}: " for g in range(100, 110)]
    plain = prepare_model(load_config(None, overrides(vault, tmp_path)))
    cfg = load_config(None, overrides(vault, tmp_path, "model.warm_start.tool_share=0.9",
                                      f"model.warm_start.demonstrations={vault}:demonstrate"))
    shown = prepare_model(cfg)
    assert calls(plain, prompts) == 0  # the warm start taught it to answer, never to call
    assert calls(shown, prompts) >= 8
    before = cache_key(cfg)
    vault.write_text(VAULT + "\n# edited\n")
    assert cache_key(cfg) != before  # the demonstrations' file is part of what the cached model was built from
