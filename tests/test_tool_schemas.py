"""What the model is shown of its tools through the chat template: each argument's description (a docstring's
`Args:`), and an environment's own tools (its class's `tools`), which it had no way to show before."""
import pytest
from test_tool_tokens import QWEN25_TEMPLATE

from rlsys.config import ConfigError, DataConfig, ToolsConfig
from rlsys.data import load_datasets
from rlsys.models.tiny import build_char_tokenizer
from rlsys.startup import load_config
from rlsys.tools.schemas import tool_schemas

ENV = '''
def guess(number: int) -> str:
    """Guess the hidden number.

    Args:
        number: a whole number from 1 to 15; the answer says
            higher, lower or correct.
    """


class Guess:
    tools = [guess]

    def reset(self, sample):
        pass

    def step(self, action):
        return "lower", 0.0, False


class Given(Guess):
    tools = [{"type": "function", "function": {"name": "look", "description": "Look around.",
                                               "parameters": {"type": "object", "properties": {}}}}]


class Bad(Guess):
    tools = "guess"


class Silent(Guess):
    tools = None
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "guess_env.py"
    path.write_text(ENV)
    return path


def test_an_environment_s_tools_reach_the_prompt_with_their_argument_descriptions(env):
    schemas = tool_schemas(ToolsConfig(env=f"{env}:Guess"))
    assert schemas == [{"type": "function", "function": {
        "name": "guess", "description": "Guess the hidden number.",
        "parameters": {"type": "object", "required": ["number"], "properties": {"number": {
            "type": "integer", "description": "a whole number from 1 to 15; the answer says higher, lower or correct."}}}}}]
    assert tool_schemas(ToolsConfig(env=f"{env}:Given"))[0]["function"]["name"] == "look"
    assert tool_schemas(ToolsConfig(env=f"{env}:Silent")) is None
    tok = build_char_tokenizer()
    tok.chat_template = QWEN25_TEMPLATE
    train, _ = load_datasets(DataConfig(task="guess_number", chat_template=True, train_size=3, eval_size=1), tok,
                             schemas)
    assert all('"description": "a whole number from 1 to 15; the answer says higher, lower or correct."' in p.text
               and p.text.startswith("<|im_start|>system\n") and "# Tools" in p.text for p in train)


def test_an_environment_s_tools_that_are_not_a_list_are_refused_naming_the_field(env):
    with pytest.raises(ConfigError, match=r"tools.env: .*Bad' has `tools` = 'guess'; it must be a list of schemas"):
        load_config(None, [f"tools.env={env}:Bad"])
