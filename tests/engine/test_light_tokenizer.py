"""The tokenizer built on `tokenizers` alone (engine/model/hf_tokenizer.py) against transformers' AutoTokenizer.

Same ids, same text back, same special tokens and added-token flags, same chat prompts (with and without tools,
generation prompt, a continued final message), for the embedded default model, the checkpoints the tests make
(tests/checkpoints.py) and two tokenizers written here the way real ones are: a Llama-3-style byte-level BPE
(generic class, TemplateProcessing BOS, 4.x added_tokens_decoder, tool-calling template) and a Qwen-style one
(Qwen2Tokenizer, ChatML template with tools).  Directories the light loader declines are loaded by transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.config import EngineConfig
from engine.default_model import DEFAULT_MODEL_DIR
from engine.model.hf_tokenizer import QWEN2_PRETOKENIZE_REGEX, FastTokenizer, read_tokenizer
from engine.model.tokenizer_load import load_tokenizer

TEXTS = [
    "", " ", "  ", "\n", "\t", "a", "Beautiful is better than ugly.", "Errors should never pass silently.",
    "  leading and trailing  ", "tabs\tand\nnew\r\nlines\n\n\n", "multiple     spaces", "ÜBER straße façade naïve",
    "日本語のテキストと中文", "emoji 🙂🚀 and 👩‍👩‍👧 family", "combining e\u0301 and \u00e9", "עברית ومرحبا",
    "code: def f(x):\n    return x ** 2  # comment", "numbers 1234567890 3.14159 1e-9", "it's they're we'll I'd",
    "<s>", "</s>", "<pad>", "<unk>", "text <s> inside </s> text", "<|begin_of_text|>hi<|eot_id|>", "<|eot",
    "<|im_start|>user\nhey<|im_end|>",
    "<tool_call>{\"a\": 1}</tool_call>", "mixed<|im_end|>\n<s>end", "\u200b zero width", "\x00 nul and \x7f del",
]  # fmt: skip
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
        {"role": "user", "content": "Thanks 🙂", "name": None},
    ],
    [
        {"role": "user", "content": "Grüße, ünïcode ✓", "name": "anna"},
        {"role": "assistant", "content": "Let me see", "reasoning": "the user greets", "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": {"q": "größe", "n": 2}}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
    ],
    [{"role": "user", "content": str(i)} for i in range(7)],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am "}],
]  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]  # fmt: skip

LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + " (" + strftime_now("%Y")[:2] + ")\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, respond with a JSON function call.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content | tojson }}
        {{- "<|eot_id|>" }}
        {%- continue %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags."
        + "<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
        or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{ message.content }}{% endgeneration %}
        {{- '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
# Whitespace-sensitive (plain block tags: trim_blocks/lstrip_blocks decide the text) and using every helper
FEATURE_TEMPLATE = """{% set ns = namespace(users=0, last=none) %}
{% for message in messages %}
    {% if message.role == 'user' %}
        {% set ns.users = ns.users + 1 %}
    {% endif %}
    {% if message.name is defined %}
        [{{ message.role }} named {{ message.name }}]
    {% endif %}
    {% if message.role == 'tool' %}{% continue %}{% endif %}
<{{ message.role }}>{% generation %}{{ message.content | tojson }}{% endgeneration %}
    {% if message.reasoning_content is defined %}(thinking: {{ message.thinking }}){% endif %}
    {% if message.tool_calls is defined %}
        {% for call in message.tool_calls %}
{{ call.function | tojson(indent=2, sort_keys=True) }}|{{ call | tojson(separators=(",", ":")) }}
            {% break %}
        {% endfor %}
    {% endif %}
{% endfor %}
{% set meta = dict(users=ns.users, tools=(tools | length if tools else 0)) %}
{{ meta | tojson }}
{% if tools %}{{ tools[0] | tojson(ensure_ascii=True) }}{% endif %}
{% if messages | length > 5 %}{{ raise_exception("too long: " ~ messages | length) }}{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""
CORPUS = [line for t in TEXTS for line in [t] * 3] + [
    "Simple is better than complex. Complex is better than complicated. Flat is better than nested.",
    "Sparse is better than dense. Readability counts. Special cases aren't special enough to break the rules.",
    "Although practicality beats purity. In the face of ambiguity, refuse the temptation to guess.",
    "The quick brown fox jumps over the lazy dog 0123456789 times; ÜBER 日本語 🙂",
    "get_weather city Paris temperature tool call function arguments parameters assistant user system",
] * 4


def _train(pre_tokenizer: Any, normalizer: Any, specials: list[str], vocab_size: int = 700) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _added_decoder(tok: Tokenizer) -> dict[str, Any]:
    """tokenizer_config.json's added_tokens_decoder as transformers 4 writes it."""
    return {str(i): {k: v for k, v in t.__getstate__().items()} for i, t in tok.get_added_tokens_decoder().items()}


def make_llama3_style(root: Path) -> Path:
    """Byte-level BPE with Llama 3's split, BOS from a TemplateProcessing, reserved special tokens and one plain
    added token; tokenizer_config as transformers 4 saves it (added_tokens_decoder, clean-up on).  Beyond Llama 3:
    tokenizer.json's padding names the pad token, and the EOS token is saved as not special."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _train(
        pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]),
        None,
        specials,
    )  # fmt: skip
    tok.add_special_tokens([AddedToken(f"<|reserved_special_token_{i}|>", special=True) for i in range(3)])
    tok.add_tokens([AddedToken("<|python_tag|>", special=False, normalized=False)])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
            special_tokens=[("<|begin_of_text|>", bos)],
        ),
    ])  # fmt: skip
    tok.enable_padding(pad_id=tok.token_to_id("<|end_of_text|>"), pad_token="<|end_of_text|>")  # the pad token
    out = root / "llama3-style"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    added = _added_decoder(tok)
    added[str(tok.token_to_id("<|eot_id|>"))]["special"] = False  # a named special token saved as not special
    config = {
        "added_tokens_decoder": added,
        "bos_token": "<|begin_of_text|>",
        "chat_template": LLAMA3_TEMPLATE,
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def make_qwen_style(root: Path) -> Path:
    """Qwen2's pipeline (NFC, its split, byte-level without regex), ChatML special tokens, <tool_call> as a
    non-special added token; Qwen2Tokenizer in tokenizer_config, a qwen2 config.json beside it."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = _train(
        pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]),
        normalizers.NFC(),
        [],
    )  # fmt: skip
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out = root / "qwen-style"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    added = _added_decoder(tok)
    added[str(tok.token_to_id("<|im_start|>"))].update(lstrip=True, normalized=True)  # Qwen2Tokenizer resets these
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": QWEN_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    return out


def make_v5_style_with_extras(root: Path) -> Path:
    """The default tokenizer as transformers 5 saves one (no added_tokens_decoder), with a special_tokens_map.json,
    a pad token the vocabulary lacks, special tokens split as text, padding on in tokenizer.json, flags on an added
    token, and two named chat templates."""
    out = root / "v5-extras"
    shutil.copytree(DEFAULT_MODEL_DIR, out, ignore=shutil.ignore_patterns("*.safetensors", "__pycache__", "*.py"))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken("<sep>", lstrip=True, rstrip=True, special=False)])
    tok.enable_padding(pad_id=3, pad_token="<pad>", length=64)
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(split_special_tokens=True, pad_token="<PAD>", additional_special_tokens=["<extra_a>"])
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "special_tokens_map.json").write_text(json.dumps({"mask_token": {"content": "<mask>", "lstrip": True}}))
    (out / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "tool_use.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ tools | length }}"
    )
    return out


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "default": DEFAULT_MODEL_DIR,
        "llama3-style": make_llama3_style(root),
        "qwen-style": make_qwen_style(root),
        "v5-extras": make_v5_style_with_extras(root),
    }


def _hf(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _light(path: Path) -> FastTokenizer:
    tok, why = read_tokenizer(path)
    assert tok is not None, why
    return tok


def _outcome(fn: Any) -> Any:
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the same conversations must fail the same way
        return ("error", type(e).__name__)


def assert_same_tokenizer(light: FastTokenizer, hf: Any) -> None:
    special = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    for name in special:
        assert getattr(light, name) == getattr(hf, name), name
        assert getattr(light, name + "_id") == getattr(hf, name + "_id"), name + "_id"
    assert light.special_tokens_map == hf.special_tokens_map
    assert light.all_special_tokens == hf.all_special_tokens and light.all_special_ids == hf.all_special_ids
    assert len(light) == len(hf) and light.vocab_size == hf.vocab_size
    assert {i: repr(t) for i, t in light.added_tokens_decoder.items()} == {
        i: repr(t) for i, t in hf.added_tokens_decoder.items()
    }
    assert light.chat_template == hf.chat_template
    assert light.is_fast and light._tokenizer.encode_special_tokens == hf._tokenizer.encode_special_tokens
    for text in TEXTS:
        for add in (True, False):
            ids = hf(text, add_special_tokens=add)["input_ids"]
            assert light(text, add_special_tokens=add)["input_ids"] == ids, (text, add)
            assert light.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add)
            assert light(text, add_special_tokens=add) == dict(hf(text, add_special_tokens=add))
            for skip in (True, False):
                for clean in (None, True, False):
                    kw = {} if clean is None else {"clean_up_tokenization_spaces": clean}
                    assert light.decode(ids, skip_special_tokens=skip, **kw) == hf.decode(
                        ids, skip_special_tokens=skip, **kw
                    ), (text, skip, clean)
    batch = TEXTS[:6]
    assert light(batch)["input_ids"] == hf(batch)["input_ids"]
    assert light.decode(3) == hf.decode(3) and light.batch_decode([[3, 4], [5]]) == hf.batch_decode([[3, 4], [5]])
    every_id = list(range(len(hf)))
    assert light.decode(every_id) == hf.decode(every_id)
    assert light.convert_ids_to_tokens(every_id) == hf.convert_ids_to_tokens(every_id)


def assert_same_chat(light: FastTokenizer, hf: Any) -> None:
    if hf.chat_template is None:
        return
    cases = []
    for conversation in CONVERSATIONS:
        for tools in (None, TOOLS):
            for gen in (True, False):
                cases.append(dict(conversation=conversation, tools=tools, add_generation_prompt=gen, tokenize=False))
        cases.append(dict(conversation=conversation, continue_final_message=True, tokenize=False))
        cases.append(dict(conversation=conversation, tokenize=True, return_dict=False, add_generation_prompt=True))
    cases.append(dict(conversation=CONVERSATIONS[:2], tokenize=False, add_generation_prompt=True))  # a batch
    cases.append(dict(conversation=CONVERSATIONS[0], tokenize=False, chat_template="{{ messages | tojson }}"))
    cases.append(dict(conversation=CONVERSATIONS[1], tokenize=False, date_string="1 Jan 2026", enable_thinking=False))
    rendered = 0
    for case in cases:
        mine = _outcome(lambda: light.apply_chat_template(**case))
        assert mine == _outcome(lambda: hf.apply_chat_template(**case)), case
        rendered += mine[0] == "ok"
    assert rendered >= len(cases) // 2


@pytest.mark.parametrize("name", ["default", "llama3-style", "qwen-style", "v5-extras"])
def test_the_light_tokenizer_is_transformers_tokenizer(fixtures, name):
    light, hf = _light(fixtures[name]), _hf(fixtures[name])
    print(f"{name}: transformers built {type(hf).__name__}; {light!r}")
    assert_same_tokenizer(light, hf)
    assert_same_chat(light, hf)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "opt"])
def test_the_test_checkpoints_tokenizers(checkpoint, arch):
    """The checkpoints tests/checkpoints.py makes carry the embedded tokenizer beside a config of their own type.
    transformers 5 loads a qwen2 one as Qwen2Tokenizer (Qwen's own split over this vocabulary), which the light
    loader does not reproduce: it declines it, and the engine gets transformers' tokenizer."""
    path = checkpoint(arch)
    light, why = read_tokenizer(path)
    hf = _hf(path)
    if arch == "qwen2":
        assert light is None and "Qwen2" in why, why
        assert type(load_tokenizer(EngineConfig(model=str(path)))) is type(hf)
        return
    assert light is not None, why
    assert_same_tokenizer(light, hf)
    assert_same_chat(light, hf)


def test_the_engine_loads_the_light_tokenizer_for_the_default_model():
    assert type(load_tokenizer(EngineConfig())) is FastTokenizer


def _variant(src: Path, dst: Path, config_changes: dict[str, Any], drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "__pycache__", "*.py"))
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    for name in drop:
        (dst / name).unlink()
    return dst


@pytest.mark.parametrize(
    "changes,drop,why",
    [
        ({}, ("tokenizer.json",), "no tokenizer.json"),
        ({"tokenizer_class": "LlamaTokenizerFast"}, (), "tokenizer_class"),
        ({"tokenizer_class": "GPT2Tokenizer"}, (), "tokenizer_class"),
        ({"auto_map": {"AutoTokenizer": ["x.Y", None]}}, (), "auto_map"),
        ({"add_bos_token": False}, (), "add_bos_token"),
        ({"add_eos_token": True}, (), "add_eos_token"),
        ({"image_token": "<image>"}, (), "model-specific"),
        ({"add_prefix_space": True}, (), "add_prefix_space"),
    ],
)
def test_what_the_light_loader_declines_transformers_loads(tmp_path, changes, drop, why):
    path = _variant(DEFAULT_MODEL_DIR, tmp_path / "t", changes, drop)
    light, reason = read_tokenizer(path)
    assert light is None and why in reason, reason
    if "tokenizer.json" in drop or "auto_map" in changes:
        return  # transformers needs other files or remote code for these
    loaded = load_tokenizer(EngineConfig(tokenizer=str(path)))
    assert type(loaded) is not FastTokenizer
    assert loaded("Beautiful is")["input_ids"] == _hf(path)("Beautiful is")["input_ids"]


def test_an_agreeing_add_bos_token_keeps_the_light_tokenizer(tmp_path):
    path = _variant(DEFAULT_MODEL_DIR, tmp_path / "t", {"add_bos_token": True, "add_eos_token": False})
    assert_same_tokenizer(_light(path), _hf(path))


def test_a_declined_tokenizer_is_logged_at_debug(tmp_path):
    from tests.debug_logs import debug_logs

    path = _variant(DEFAULT_MODEL_DIR, tmp_path / "t", {"tokenizer_class": "LlamaTokenizerFast"})
    with debug_logs() as logs:
        load_tokenizer(EngineConfig(tokenizer=str(path)))
    [line] = [entry for entry in logs if entry["event"] == "tokenizer_loaded_by_transformers"]
    assert line["log_level"] == "debug" and "LlamaTokenizerFast" in line["reason"]


def test_qwen2_pretokenize_regex_is_transformers(fixtures):
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_PRETOKENIZE_REGEX == PRETOKENIZE_REGEX


def test_a_qwen2_tokenizer_with_another_pipeline_is_declined(tmp_path, fixtures):
    """Qwen2Tokenizer builds Qwen's pipeline in code (transformers 5): a tokenizer.json with another split is
    tokenized differently there, so it is left to transformers."""
    path = _variant(fixtures["llama3-style"], tmp_path / "t", {"tokenizer_class": "Qwen2Tokenizer"})
    light, why = read_tokenizer(path)
    assert light is None and "Qwen2Tokenizer whose" in why, why


def test_structured_outputs_see_the_same_grammar_tokenizer(fixtures):
    """llguidance's tokenizer from the light tokenizer is the one llguidance.hf.from_tokenizer makes."""
    import llguidance
    import llguidance.hf

    from engine.structured_output import GrammarCompiler

    for name in ("default", "llama3-style", "qwen-style"):
        light, hf = _light(fixtures[name]), _hf(fixtures[name])
        eos = frozenset([light.eos_token_id])
        mine = GrammarCompiler(light, len(light), eos)._llg_tokenizer()
        theirs = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=sorted(eos))
        assert mine.vocab_size == theirs.vocab_size and mine.eos_token == theirs.eos_token
        for text in TEXTS:
            assert mine.tokenize_str(text) == theirs.tokenize_str(text), (name, text)
        grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        assert llguidance.LLMatcher.validate_grammar(grammar, mine) == ""
