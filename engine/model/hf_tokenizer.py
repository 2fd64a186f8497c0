"""A checkpoint's tokenizer on the `tokenizers` library, built as transformers builds it, without transformers.

transformers' fast tokenizers are a Python layer over a `tokenizers.Tokenizer` read from tokenizer.json; the engine
uses a small part of that layer (call/encode/decode, the special tokens and their ids, the chat template).  This
module rebuilds the layer for the tokenizer classes whose behaviour it can reproduce exactly:

- the generic class (`PreTrainedTokenizerFast`, transformers 5's `TokenizersBackend`): tokenizer.json as it is, plus
  what transformers adds at load time: the added tokens of tokenizer_config.json (their flags too), special tokens
  it names that the vocabulary lacks, a pad token from tokenizer.json's padding, `split_special_tokens`;
- `Qwen2Tokenizer` (which transformers 5 also picks for a qwen2 config with the generic class) when tokenizer.json's
  normalizer, pre-tokenizer, decoder and BPE settings are the ones that class builds, and its added tokens keep the
  ids the class would give them: then transformers 4 (which reads tokenizer.json) and 5 (which rebuilds the
  pipeline in code) agree, and so does this.

BOS/EOS come from tokenizer.json's post-processor, as both versions do for these classes when tokenizer.json exists;
a tokenizer_config `add_bos_token`/`add_eos_token` that says otherwise is left to transformers.  Anything else (no
tokenizer.json, another class, remote code, model-specific special tokens, legacy added_tokens.json) makes
`read_tokenizer` return None with the reason, and the loader uses transformers' AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from engine.model.hf_config import read_hf_config
from engine.model.jinja_chat import pick_template, render_conversations

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
QWEN2_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast")
# The pre-tokenizer split of Qwen2's tokenizer (transformers' Qwen2Tokenizer builds it with this pattern).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2Tokenizer's defaults for special tokens tokenizer_config does not name
QWEN2_DEFAULTS = {
    "unk_token": "<|endoftext|>",
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
}
_ADDED_TOKEN_KEYS = frozenset(("content", "lstrip", "rstrip", "normalized", "single_word", "special"))
# apply_chat_template arguments of transformers' that this tokenizer does not implement, with their no-op values
_CHAT_ARGS_NOT_IMPLEMENTED = {
    "padding": (False, None),
    "truncation": (False, None),
    "max_length": (None,),
    "return_tensors": (None,),
    "return_assistant_tokens_mask": (False,),
    "tokenizer_kwargs": (None,),
    "sanitize_control_tokens": (False,),
}


class Unsupported(Exception):
    """This tokenizer is left to transformers (the message says why)."""


class FastTokenizer:
    """The part of transformers' fast-tokenizer interface the engine, its tests and the offline API use."""

    is_fast = True

    def __init__(
        self,
        backend: Tokenizer,
        *,
        specials: dict[str, str],
        extra_specials: list[str],
        chat_template: str | dict[str, str] | None,
        name_or_path: str,
        clean_up_tokenization_spaces: bool = False,
        clean_up_bpe: bool = False,
        split_special_tokens: bool = False,
        model_max_length: int | None = None,
        model_input_names: list[str] | None = None,
        padding_side: str = "right",
        truncation_side: str = "right",
    ) -> None:
        self._tokenizer = backend  # transformers' name: the detokenizer decodes on it directly
        self._specials = specials
        self._extra_specials = extra_specials
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._clean_up_bpe = clean_up_bpe
        self.split_special_tokens = split_special_tokens
        self.model_max_length = model_max_length if model_max_length is not None else int(1e30)
        self.model_input_names = list(model_input_names or ["input_ids", "attention_mask"])
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        self._is_bpe = json.loads(backend.to_str())["model"].get("type") == "BPE"

    # -- vocabulary --------------------------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def __len__(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def __bool__(self) -> bool:
        return True

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tokenizer.get_vocab(with_added_tokens=True))

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self._tokenizer.get_added_tokens_decoder())

    def get_added_vocab(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        if isinstance(tokens, str):
            found = self._tokenizer.token_to_id(tokens)
            return found if found is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # -- special tokens ----------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """`bos_token`, `eos_token_id` and the rest of transformers' special-token attributes."""
        base = name.removesuffix("_id")
        if base in SPECIAL_NAMES:
            token = self.__dict__.get("_specials", {}).get(base)
            if token is None:
                return None
            return self.convert_tokens_to_ids(token) if name != base else token
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: self._specials[name] for name in SPECIAL_NAMES if self._specials.get(name) is not None}

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self._extra_specials)

    @property
    def all_special_tokens(self) -> list[str]:
        out: list[str] = []
        for token in [*self.special_tokens_map.values(), *self._extra_specials]:
            if token not in out:
                out.append(token)
        return out

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.convert_tokens_to_ids(self.all_special_tokens))

    # -- encoding and decoding ---------------------------------------------------------------------------------

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """{"input_ids": [...], "attention_mask": [...]} for one text; lists of them for a list of texts."""
        if isinstance(text, str):
            return self._as_dict([self._tokenizer.encode(text, add_special_tokens=add_special_tokens)], batched=False)
        if isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
            encodings = self._tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
            return self._as_dict(encodings, batched=True)
        raise ValueError("text input must be of type `str` (single example) or `list[str]` (batch)")

    def _as_dict(self, encodings: list[Any], batched: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"input_ids": [list(e.ids) for e in encodings]}
        if "token_type_ids" in self.model_input_names:
            out["token_type_ids"] = [list(e.type_ids) for e in encodings]
        if "attention_mask" in self.model_input_names:
            out["attention_mask"] = [list(e.attention_mask) for e in encodings]
        return out if batched else {k: v[0] for k, v in out.items()}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self(text, add_special_tokens=add_special_tokens)["input_ids"])

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens)

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return int(self._tokenizer.num_special_tokens_to_add(pair))

    def decode(
        self, token_ids: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> Any:
        """Text of one sequence of ids (an int, a list, an array or a tensor), or a list of texts for a batch."""
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
        if isinstance(ids, int):
            ids = [ids]
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        if isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple)):
            return [self._decode(list(s), skip_special_tokens, clean_up_tokenization_spaces) for s in ids]
        return self._decode(list(ids), skip_special_tokens, clean_up_tokenization_spaces)

    def batch_decode(
        self, sequences: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> list[str]:
        seqs = sequences.tolist() if hasattr(sequences, "tolist") else sequences
        return [self.decode(s, skip_special_tokens, clean_up_tokenization_spaces) for s in seqs]

    def _decode(self, ids: list[int], skip_special_tokens: bool, clean_up: bool | None) -> str:
        text = str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        clean_up = self.clean_up_tokenization_spaces if clean_up is None else clean_up
        # transformers 5 skips the clean-up for BPE (it removes real spaces before punctuation) unless told not to
        if clean_up and (not self._is_bpe or self._clean_up_bpe):
            for before, after in (
                (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
            ):  # fmt: skip
                text = text.replace(before, after)
        return text

    # -- chat --------------------------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: list[Any] | None = None) -> str:
        return pick_template(self.chat_template, chat_template, tools)

    def apply_chat_template(
        self,
        conversation: Any,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """transformers' apply_chat_template: the rendered text (tokenize=False), else its ids (return_dict=False) or
        {"input_ids", "attention_mask"}; other keyword arguments are the template's variables."""
        for name, no_op in _CHAT_ARGS_NOT_IMPLEMENTED.items():
            if name in kwargs:
                if kwargs[name] not in no_op:
                    raise NotImplementedError(f"apply_chat_template({name}=...) is not implemented by this tokenizer")
                del kwargs[name]
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        batched = isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
        )
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when "
                "you want the model to continue the final message, and add_generation_prompt when you want to add a "
                "header that will prompt it to start a new assistant message instead."
            )
        texts = render_conversations(
            template,
            list(conversation) if batched else [conversation],
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs={**self.special_tokens_map, **kwargs},
        )
        rendered: Any = texts if batched else texts[0]
        if not tokenize:
            return rendered
        out = self(rendered, add_special_tokens=False)
        return out if return_dict else out["input_ids"]

    def __repr__(self) -> str:
        return (
            f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, len={len(self)}, "
            f"special_tokens={self.special_tokens_map})"
        )


# -- loading ---------------------------------------------------------------------------------------------------


def read_tokenizer(directory: Path) -> tuple[FastTokenizer | None, str]:
    """(the tokenizer, "") or (None, why transformers must load it)."""
    try:
        return _build(directory), ""
    except Unsupported as e:
        return None, str(e)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise Unsupported(f"{path.name} is not readable JSON ({type(e).__name__})") from None


def _build(directory: Path) -> FastTokenizer:
    tokenizer_file = directory / "tokenizer.json"
    config_file = directory / "tokenizer_config.json"
    if not tokenizer_file.is_file():
        raise Unsupported("no tokenizer.json")
    if not config_file.is_file():
        raise Unsupported("no tokenizer_config.json")
    if (directory / "added_tokens.json").exists():
        raise Unsupported("a legacy added_tokens.json")
    kw = _read_json(config_file)
    if not isinstance(kw, dict):
        raise Unsupported("tokenizer_config.json is not an object")
    for key in ("auto_map", "fast_tokenizer_files", "fix_mistral_regex", "init_inputs", "tokenizer_file"):
        if kw.get(key):
            raise Unsupported(f"tokenizer_config.json sets {key}")
    qwen2 = _is_qwen2(str(kw.pop("tokenizer_class", None)), _model_type(directory))

    tokenizer_json = _read_json(tokenizer_file)
    try:
        backend = Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the tokenizers library's own error type
        raise Unsupported(f"tokenizer.json does not load ({e})") from None
    add_bos, add_eos = kw.pop("add_bos_token", None), kw.pop("add_eos_token", None)
    template = _chat_templates(directory, kw.get("chat_template"))
    if template is not None:
        kw["chat_template"] = template
    if "additional_special_tokens" in kw and not kw.get("extra_special_tokens"):
        kw["extra_special_tokens"] = kw.pop("additional_special_tokens")
    added = _added_tokens(directory, kw, tokenizer_json)
    if "additional_special_tokens" in kw and "extra_special_tokens" not in kw:
        kw["extra_special_tokens"] = kw.pop("additional_special_tokens")
    kw = _convert_added_tokens(kw)
    if any(k.endswith("_token") and k not in SPECIAL_NAMES and isinstance(v, (str, AddedToken)) for k, v in kw.items()):
        raise Unsupported("model-specific special tokens")
    if isinstance(kw.get("extra_special_tokens"), dict):
        raise Unsupported("model-specific special tokens")
    by_content = {str(t): t for t in added.values()}
    for name in SPECIAL_NAMES:
        if kw.get(name) is not None and by_content:
            kw[name] = by_content.get(str(kw[name]), kw[name])
    if qwen2:
        for name, default in QWEN2_DEFAULTS.items():
            kw.setdefault(name, default)
        _check_qwen2_pipeline(tokenizer_json, kw.get("add_prefix_space"), added)
    else:
        _check_prefix_space(tokenizer_json, kw.get("add_prefix_space"))
    if backend.padding is not None:
        kw.setdefault("pad_token", backend.padding["pad_token"])
    backend.no_padding()  # transformers turns both off for every call that does not ask for them
    backend.no_truncation()

    specials: dict[str, Any] = {}
    for name in SPECIAL_NAMES:
        value = kw.get(name)
        if value is not None and not isinstance(value, (str, AddedToken)):
            raise Unsupported(f"{name} is a {type(value).__name__}")
        specials[name] = value
    extras = kw.get("extra_special_tokens") or []
    if not isinstance(extras, (list, tuple)) or not all(isinstance(t, (str, AddedToken)) for t in extras):
        raise Unsupported("extra_special_tokens is not a list of tokens")
    split = kw.get("split_special_tokens", False)
    if type(split) is not bool:
        raise Unsupported("split_special_tokens is not a bool")
    for side in ("padding_side", "truncation_side"):
        if kw.get(side, "right") not in ("left", "right"):
            raise Unsupported(f"{side} {kw.get(side)!r}")
    backend.encode_special_tokens = split
    _add_load_time_tokens(backend, added, specials, list(extras))
    if qwen2:  # Qwen2Tokenizer re-adds its special tokens with the default flags
        named = [str(v) for v in specials.values() if v is not None] + [str(t) for t in extras]
        backend.add_tokens([AddedToken(t, special=True) for t in dict.fromkeys(named)])
    tokenizer = FastTokenizer(
        backend,
        specials={k: str(v) for k, v in specials.items() if v is not None},
        extra_specials=[str(t) for t in extras],
        chat_template=kw.get("chat_template"),
        name_or_path=str(directory),
        clean_up_tokenization_spaces=bool(kw.get("clean_up_tokenization_spaces", False)),
        clean_up_bpe=bool(kw.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)),
        split_special_tokens=split,
        model_max_length=kw.get("model_max_length", kw.get("max_len")),
        model_input_names=kw.get("model_input_names"),
        padding_side=kw.get("padding_side", "right"),
        truncation_side=kw.get("truncation_side", "right"),
    )
    _check_bos_eos(tokenizer, add_bos, add_eos)
    return tokenizer


def _model_type(directory: Path) -> str | None:
    """The model type AutoTokenizer reads from the tokenizer directory's config.json (None without one)."""
    if not (directory / "config.json").exists():
        return None
    config, why = read_hf_config(directory)  # what AutoConfig makes of it, or left to transformers
    if config is None:
        raise Unsupported(f"the tokenizer directory's config.json: {why}")
    return str(config.model_type)


def _is_qwen2(tokenizer_class: str, model_type: str | None) -> bool:
    if tokenizer_class in GENERIC_CLASSES:
        if model_type == "mistral":
            import importlib.util

            if importlib.util.find_spec("mistral_common") is not None:
                raise Unsupported("a mistral tokenizer with mistral_common installed (transformers may use it)")
        return model_type == "qwen2"
    if tokenizer_class in QWEN2_CLASSES and model_type != "mistral":
        return True
    raise Unsupported(f"tokenizer_class {tokenizer_class!r} with model_type {model_type!r}")


def _chat_templates(directory: Path, configured: Any) -> Any:
    """chat_template.jinja (over tokenizer_config's), or a dict with additional_chat_templates/*.jinja."""
    templates: dict[str, str] = {}
    main = directory / "chat_template.jinja"
    if main.is_file():
        templates["default"] = main.read_text(encoding="utf-8")
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    if isinstance(configured, (list, tuple)):  # saved as [{"name", "template"}]
        return {t["name"]: t["template"] for t in configured}
    return configured


def _added_token(fields: Any, special: bool | None = None) -> AddedToken:
    if not isinstance(fields, dict) or not set(fields) <= _ADDED_TOKEN_KEYS or "content" not in fields:
        raise Unsupported(f"an added token {fields!r:.80}")
    fields = dict(fields)
    if special is not None:
        fields.pop("special", None)
        fields["special"] = special
    return AddedToken(**fields)


def _added_tokens(directory: Path, kw: dict[str, Any], tokenizer_json: dict[str, Any]) -> dict[int, AddedToken]:
    """The added tokens transformers re-adds at load: tokenizer_config's added_tokens_decoder, else those of
    tokenizer.json (special_tokens_map.json's named tokens then override tokenizer_config's)."""
    if "added_tokens_decoder" in kw:
        decoder = kw.pop("added_tokens_decoder")
        if not isinstance(decoder, dict):
            raise Unsupported("added_tokens_decoder is not an object")
        return {int(i): _added_token(t) for i, t in decoder.items()}
    stm_file = directory / "special_tokens_map.json"
    if stm_file.exists():
        stm = _read_json(stm_file)
        if not isinstance(stm, dict):
            raise Unsupported("special_tokens_map.json is not an object")
        for key, value in stm.items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = _added_token(value, special=True)
            elif isinstance(value, list) and not all(isinstance(v, str) for v in value):
                raise Unsupported(f"special_tokens_map.json {key} lists token objects")
            elif key == "extra_special_tokens" and isinstance(value, list):
                existing = list(kw.get("extra_special_tokens") or [])
                value = existing + [v for v in value if v not in existing]
            kw[key] = value
    added = {}
    for token in tokenizer_json.get("added_tokens") or []:
        token = dict(token)
        index = int(token.pop("id"))
        added[index] = _added_token(token)
    return added


def _convert_added_tokens(obj: Any) -> Any:
    """tokenizer_config's {"__type": "AddedToken", ...} objects as AddedTokens (transformers' convert_added_tokens)."""
    if isinstance(obj, dict) and obj.get("__type") == "AddedToken":
        fields = {k: v for k, v in obj.items() if k != "__type"}
        return _added_token(fields)
    if isinstance(obj, (list, tuple)):
        return [_convert_added_tokens(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _convert_added_tokens(v) for k, v in obj.items()}
    return obj


def _add_load_time_tokens(
    backend: Tokenizer, added: dict[int, AddedToken], specials: dict[str, Any], extras: list[Any]
) -> None:
    """What transformers' fast tokenizer adds when it loads: every configured added token again (their flags win
    over tokenizer.json's), then the named and extra special tokens the vocabulary lacks, as special tokens."""
    to_add: list[Any] = [token for _, token in sorted(added.items())]
    # as transformers compares them: contents against the list made before this loop, objects by equality
    known = [t.content for t in backend.get_added_tokens_decoder().values()] + [str(t) for t in to_add]
    for value in [*specials.values(), *extras]:
        if value is not None and str(value) not in known and value not in to_add:
            to_add.append(value)
    named = [str(v) for v in specials.values() if v]
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named:
            token = AddedToken(**{**token.__getstate__(), "special": True})
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def _pre_tokenizers(section: Any) -> list[dict[str, Any]]:
    if not isinstance(section, dict):
        return []
    if section.get("type") == "Sequence":
        return [p for p in section.get("pretokenizers", []) if isinstance(p, dict)]
    return [section]


def _check_prefix_space(tokenizer_json: dict[str, Any], add_prefix_space: Any) -> None:
    """transformers versions differ on whether tokenizer_config's add_prefix_space rewrites the pre-tokenizer:
    only a setting tokenizer.json already has is vouched for."""
    if add_prefix_space is None:
        return
    flags = [
        p["add_prefix_space"] for p in _pre_tokenizers(tokenizer_json.get("pre_tokenizer")) if "add_prefix_space" in p
    ]
    if flags != [add_prefix_space] * len(flags):
        raise Unsupported(f"add_prefix_space={add_prefix_space!r} that tokenizer.json's pre-tokenizer does not have")


def _check_qwen2_pipeline(tokenizer_json: dict[str, Any], add_prefix_space: Any, added: dict[int, AddedToken]) -> None:
    """Qwen2Tokenizer (transformers 5) keeps tokenizer.json's vocabulary, merges and post-processor but builds the
    rest in code: vouched for only when tokenizer.json's is that, and its added tokens get the same ids."""
    model = tokenizer_json.get("model") or {}
    expected_model = {
        "type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False, "byte_fallback": False,
        "ignore_merges": False,
    }  # fmt: skip
    if any(model.get(k, False if k == "ignore_merges" else None) != v for k, v in expected_model.items()):
        raise Unsupported("a Qwen2Tokenizer whose BPE settings are not Qwen2's")
    if model.get("continuing_subword_prefix") not in (None, "") or model.get("end_of_word_suffix") not in (None, ""):
        raise Unsupported("a Qwen2Tokenizer with subword prefixes or suffixes")
    if tokenizer_json.get("normalizer") != {"type": "NFC"}:
        raise Unsupported("a Qwen2Tokenizer whose normalizer is not NFC")
    split, byte_level = ({}, {}) if len(pre := _pre_tokenizers(tokenizer_json.get("pre_tokenizer"))) != 2 else pre
    if (
        tokenizer_json.get("pre_tokenizer", {}).get("type") != "Sequence"
        or split.get("type") != "Split"
        or split.get("pattern") != {"Regex": QWEN2_PRETOKENIZE_REGEX}
        or split.get("behavior") != "Isolated"
        or split.get("invert") is not False
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space") is not bool(add_prefix_space)
        or byte_level.get("use_regex") is not False
    ):
        raise Unsupported("a Qwen2Tokenizer whose pre-tokenizer is not Qwen2's")
    if (tokenizer_json.get("decoder") or {}).get("type") != "ByteLevel":
        raise Unsupported("a Qwen2Tokenizer whose decoder is not byte-level")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise Unsupported("a Qwen2Tokenizer without a vocabulary object")
    in_json = {int(t["id"]): t["content"] for t in tokenizer_json.get("added_tokens") or []}
    if in_json != {i: t.content for i, t in added.items()}:
        raise Unsupported("tokenizer.json's added tokens are not tokenizer_config's")
    next_id = len(vocab)
    for i, token in sorted(added.items()):
        if token.content in vocab:
            ok = vocab[token.content] == i
        else:
            ok, next_id = i == next_id, next_id + 1
        if not ok:
            raise Unsupported("added tokens whose ids Qwen2Tokenizer would number differently")


def _check_bos_eos(tokenizer: FastTokenizer, add_bos: Any, add_eos: Any) -> None:
    """tokenizer.json's post-processor decides BOS/EOS; an add_bos_token/add_eos_token that disagrees with it is
    read differently by transformers 4's model classes, so such a tokenizer is left to transformers."""
    if add_bos is None and add_eos is None:
        return
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    try:
        at = next(i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain)
    except StopIteration:
        raise Unsupported("a post-processor that rewrites the text's tokens") from None
    prefix, suffix = full[:at], full[at + len(plain) :]
    if add_bos is not None and bool(add_bos) != (prefix == [tokenizer.bos_token_id] and prefix != [None]):
        raise Unsupported(f"add_bos_token={add_bos} where tokenizer.json's post-processor adds {prefix}")
    if add_eos is not None and bool(add_eos) != (suffix == [tokenizer.eos_token_id] and suffix != [None]):
        raise Unsupported(f"add_eos_token={add_eos} where tokenizer.json's post-processor adds {suffix}")
