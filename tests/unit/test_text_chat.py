"""Chat templates (shardserve.text.chat, shardserve.text.folder): the jinja2 environment
transformers renders with, the files a template comes from, and the errors a template raises."""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from shardserve.errors import BadInputError
from shardserve.text.chat import ChatTemplate
from shardserve.text.folder import TokenizerFolder
from shardserve.text.tokenizer import TextModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
USER = [{"role": "user", "content": "Héllo <b>&'日本'"}]


def render(source: str, messages: list[dict[str, str]] = USER, **tokens: str) -> str:
    return ChatTemplate(source, tokens, "servable t").render(messages)


def test_trim_blocks_and_lstrip_blocks_as_transformers() -> None:
    source = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n"
        "[{{ m.content }}]\n{% endif %}\n{% endfor %}"
    )
    assert render(source, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == (
        "[a]\n[b]\n"
    )


def test_tojson_does_not_escape_html_or_non_ascii_and_takes_json_dumps_options() -> None:
    assert render("{{ messages[0] | tojson }}") == json.dumps(USER[0], ensure_ascii=False)
    assert render("{{ messages[0] | tojson(indent=2, sort_keys=True) }}") == json.dumps(
        USER[0], ensure_ascii=False, indent=2, sort_keys=True
    )


def test_raise_exception_is_a_400_with_the_templates_message() -> None:
    source = (
        "{% if messages[0].role != 'system' %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    )
    with pytest.raises(BadInputError, match="Conversation roles must alternate") as caught:
        render(source)
    assert caught.value.status == 400


def test_a_template_failing_otherwise_is_a_400_too() -> None:
    with pytest.raises(BadInputError, match="ZeroDivisionError"):
        render("{{ 1 // 0 }}")
    with pytest.raises(BadInputError, match="does not compile"):
        render("{% for m in messages %}")


def test_special_tokens_tools_and_generation_prompt_are_variables() -> None:
    source = (
        "{{ bos_token }}{{ tools is none }}{{ documents is none }}"
        "{% if add_generation_prompt %}<gen>{{ eos_token }}{% endif %}"
    )
    assert render(source, bos_token="<s>", eos_token="</s>") == "<s>TrueTrue<gen></s>"
    template = ChatTemplate("{{ add_generation_prompt }}", {})
    assert template.render(USER, add_generation_prompt=False) == "False"


def test_strftime_now_loop_controls_and_generation_blocks() -> None:
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    source = "{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert render(source) == "1"
    assert render("{% generation %}{{ messages[0].role }}{% endgeneration %}!") == "user!"


def test_the_sandbox_refuses_mutation_and_internals() -> None:
    with pytest.raises(BadInputError, match="SecurityError|unsafe|not safely"):
        render("{{ messages.append(1) }}")
    with pytest.raises(BadInputError):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}")


def copied_checkpoint(model: str, target: Path) -> Path:
    shutil.copytree(FIXTURES / model, target / model)
    return target / model


def edit_config(folder: Path, **fields: object) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def test_chat_template_jinja_beside_the_config_wins(tmp_path: Path) -> None:
    folder = copied_checkpoint("qwen2", tmp_path)
    (folder / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
    assert TextModel.load(folder).render_chat(USER) == "JINJA " + USER[0]["content"]


def test_a_list_of_templates_uses_the_default(tmp_path: Path) -> None:
    folder = copied_checkpoint("qwen2", tmp_path)
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "D"}]
    edit_config(folder, chat_template=templates)
    assert TextModel.load(folder).render_chat(USER) == "D"
    edit_config(folder, chat_template=templates[:1])
    assert not TextModel.load(folder).has_chat_template


def test_special_tokens_may_be_added_token_dicts_and_the_config_wins(tmp_path: Path) -> None:
    folder = copied_checkpoint("mistral", tmp_path)
    edit_config(
        folder,
        bos_token={"content": "<s>", "lstrip": False, "special": True},
        eos_token=None,
        additional_special_tokens=[{"content": "[INST]"}, "[/INST]"],
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<other>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"})
    )
    tokens = TokenizerFolder.read(folder).special_tokens
    assert tokens == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "additional_special_tokens": ["[INST]", "[/INST]"],
    }


def test_the_llama_fixture_template_renders_as_transformers() -> None:
    """One reference rendering spelled out, so a failure here shows the text."""
    text = TextModel.load(FIXTURES / "llama")
    messages = [{"role": "user", "content": "  Hi  "}]
    rendered = text.render_chat(messages)
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert re.fullmatch(r"<\|begin_of_text\|>.*", rendered, re.S)
