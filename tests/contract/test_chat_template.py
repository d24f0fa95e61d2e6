"""Chat templates: the tokenizer's own jinja template, rendered exactly as transformers renders it.

Each template below is written into a tokenizer directory the test builds (a BPE
tokenizer trained here with ``tokenizers``); our rendering and token ids are compared
with transformers' ``apply_chat_template`` on the same directory. The router and the
replicas load the same ``ChatTemplate`` from it.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from unicache.contract.chat_template import BYTE_CHAT_TEMPLATE, ChatFormatError, ChatTemplate, render_chat
from unicache.contract.tokenizer import HFTokenizer, ByteTokenizer, load_tokenizer, special_tokens

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]

LLAMA3_STYLE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = 'Today is ' + strftime_now('%d %b %Y') + '.' %}{% set rest = messages %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ system | trim }}<|eot_id|>"
    "{% for message in rest %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CHATML_STYLE = """{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# trim_blocks/lstrip_blocks matter here (block tags on their own lines), and so do
# raise_exception, tojson (non-ASCII kept, no HTML escaping), loop controls and eos_token.
STRICT_STYLE = """{% if messages[0]['role'] == 'system' %}
    {% set loop_messages = messages[1:] %}[SYS]{{ messages[0]['content'] | tojson }}[/SYS]
{% else %}
    {% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '<s>[INST] ' + message['content'] + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
        {% generation %}{{ message['content'] + eos_token }}{% endgeneration %}
    {% endif %}
    {% if loop.index > 99 %}{% break %}{% endif %}
{% endfor %}
"""

# An AddedToken as older tokenizer_config.json files spell it.
EOT_ADDED = {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}

TEMPLATES = {"llama3": LLAMA3_STYLE, "chatml": CHATML_STYLE, "strict": STRICT_STYLE}

CONVERSATIONS = {
    "system+user": [{"role": "system", "content": "Be brief. <café> & \"quotes\""}, {"role": "user", "content": "hello world"}],
    "user-only": [{"role": "user", "content": "the café is naïve"}],
    "multi-turn": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world 🍕"},
        {"role": "user", "content": [{"type": "text", "text": "pizza "}, {"type": "text", "text": "costs 3€"}]},
    ],
}


def _flat(messages):
    """What transformers sees for OpenAI text parts: their joined text (as we pass it)."""
    return [{**m, "content": "".join(p["text"] for p in m["content"]) if isinstance(m["content"], list) else m["content"]} for m in messages]


def _tokenizer_dir(path, template, as_jinja_file=False):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the café is naïve", "pizza 🍕 costs 3€", "system user assistant"] * 20, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": EOT_ADDED}
    if as_jinja_file:
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return path


def _hf(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {name: _tokenizer_dir(root / name, src) for name, src in TEMPLATES.items()}


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_rendering_and_ids_equal_apply_chat_template(dirs, template, conversation):
    msgs = CONVERSATIONS[conversation]
    ours = HFTokenizer(str(dirs[template]))
    hf = _hf(dirs[template])
    want_text = hf.apply_chat_template(_flat(msgs), tokenize=False, add_generation_prompt=True)
    got_text = render_chat(msgs, ours.chat_template)
    assert got_text == want_text
    want_ids = hf.apply_chat_template(_flat(msgs), tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.encode(got_text) == list(want_ids)


def test_specials_in_the_rendering_become_their_ids(dirs):
    tok = HFTokenizer(str(dirs["llama3"]))
    ids = tok.encode(render_chat(CONVERSATIONS["system+user"], tok.chat_template))
    assert ids[0] == tok.bos_token_id == tok._tok.token_to_id("<|begin_of_text|>")
    assert ids.count(tok._tok.token_to_id("<|eot_id|>")) == 2 and tok.eos_token_id == tok._tok.token_to_id("<|eot_id|>")


def test_without_generation_prompt_matches_too(dirs):
    msgs = CONVERSATIONS["system+user"]
    tpl = HFTokenizer(str(dirs["chatml"])).chat_template
    want = _hf(dirs["chatml"]).apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert tpl.render(msgs, add_generation_prompt=False) == want
    assert tpl.render(msgs) == want + "<|im_start|>assistant\n"


def test_template_refusal_is_a_chat_format_error_with_its_message(dirs):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        _hf(dirs["strict"]).apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatFormatError, match="^chat template: Conversation roles must alternate user/assistant"):
        render_chat(bad, HFTokenizer(str(dirs["strict"])).chat_template)


def test_a_chat_template_jinja_file_wins_over_the_config_as_in_transformers(tmp_path):
    path = _tokenizer_dir(tmp_path / "tok", CHATML_STYLE, as_jinja_file=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": LLAMA3_STYLE}))
    msgs = CONVERSATIONS["user-only"]
    want = _hf(path).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert want.startswith("<|im_start|>system")
    assert HFTokenizer(str(path)).chat_template.render(msgs) == want


def test_transformers_saved_tokenizer_round_trips(dirs, tmp_path):
    saved = tmp_path / "saved"
    _hf(dirs["llama3"]).save_pretrained(str(saved))
    msgs = CONVERSATIONS["multi-turn"]
    want = _hf(saved).apply_chat_template(_flat(msgs), tokenize=False, add_generation_prompt=True)
    assert HFTokenizer(str(saved)).chat_template.render(msgs) == want


def test_named_templates_use_default_and_refuse_when_none_is_default(tmp_path):
    path = _tokenizer_dir(tmp_path / "tok", "")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": LLAMA3_STYLE}, {"name": "default", "template": CHATML_STYLE}]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = CONVERSATIONS["user-only"]
    assert HFTokenizer(str(path)).chat_template.render(msgs) == _hf(path).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    cfg["chat_template"] = [{"name": "tool_use", "template": LLAMA3_STYLE}, {"name": "rag", "template": CHATML_STYLE}]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="several chat templates \\(rag, tool_use\\) and none named 'default'"):
        HFTokenizer(str(path))


def test_broken_template_fails_at_load_and_missing_one_at_request(tmp_path):
    broken = _tokenizer_dir(tmp_path / "broken", "{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="^chat_template does not compile: .*\\(line 1\\)$"):
        load_tokenizer(str(broken))
    none = _tokenizer_dir(tmp_path / "none", "")
    cfg = json.loads((none / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (none / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = HFTokenizer(str(none))
    assert tok.chat_template is None
    with pytest.raises(ChatFormatError, match="has no chat_template"):
        render_chat(CONVERSATIONS["user-only"], tok.chat_template)


def test_special_tokens_are_read_like_transformers(dirs, tmp_path):
    assert special_tokens(str(dirs["llama3"])) == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    path = _tokenizer_dir(tmp_path / "legacy", LLAMA3_STYLE)
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "pad_token": "</s>"}))
    assert special_tokens(str(path)) == {"bos_token": "<s>", "eos_token": "<|eot_id|>", "pad_token": "</s>"}
    hf = _hf(path)
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<s>", "<|eot_id|>", "</s>")


def test_router_and_replica_load_one_template(dirs, tmp_path):
    from unicache.replica.engines.builtin.config import EngineConfig
    from unicache.router.app import RouterApp
    from unicache.router.config import build_config

    ckpt = dirs["chatml"]
    router = RouterApp(build_config(env={"UNICACHE_CHECKPOINT": str(ckpt)}, overrides={"use_redis": False, "auth_enabled": False})).core
    replica_tok = load_tokenizer(EngineConfig(checkpoint=str(ckpt)).tokenizer_path())
    msgs = CONVERSATIONS["multi-turn"]
    want = _hf(ckpt).apply_chat_template(_flat(msgs), tokenize=True, add_generation_prompt=True, return_dict=False)
    assert router.encode(render_chat(msgs, router.tokenizer.chat_template)) == list(want)
    assert replica_tok.encode(render_chat(msgs, replica_tok.chat_template)) == list(want)


def test_byte_tokenizer_keeps_its_template():
    assert ByteTokenizer().chat_template is BYTE_CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert render_chat(msgs, BYTE_CHAT_TEMPLATE) == "<|user|>\nhi\n<|assistant|>\n\n<|assistant|>\n"
    assert isinstance(BYTE_CHAT_TEMPLATE, ChatTemplate)
