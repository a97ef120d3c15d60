"""Hugging Face checkpoint directories: reading and writing safetensors weights.

Backend-neutral (numpy only). A checkpoint directory holds ``config.json`` and either
``model.safetensors`` or a sharded set named by ``model.safetensors.index.json``. The
backends turn a :class:`ModelSpec` into a model and move tensors between a
:class:`SafetensorsReader` and their own parameter layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401 - names bfloat16 for numpy: safetensors' numpy reader needs it
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from strop.errors import ModelError, StropError
from strop.io.atomic import atomic_directory
from strop.io.model_spec import CONFIG_FILE, read_model_spec
from strop.io.untrusted import read_json, shown_name
from strop.io.writable import writing
from strop.models import ModelSpec

SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# Files a checkpoint directory may carry besides the weights; copied along on save.
SIDECAR_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)

# Tensors some checkpoints carry that are recomputed, never loaded.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)
# Pickle checkpoints strop refuses to read (unpickling can run code); named in errors.
PICKLE_WEIGHTS_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")

# The dtypes a weight (or adapter) tensor may have. Integer, boolean, complex and 8-bit
# float tensors are not weights of the models strop supports: refused, never cast.
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")
# The largest safetensors header strop parses. safetensors' own cap is 100 MB of JSON,
# parsed in full before anything can be checked; real checkpoints' headers are well under
# 1 MB (a 70B-parameter shard: ~100 KB), so a header claiming more is rejected unread.
MAX_HEADER_BYTES = 16 * 1024**2
# A tensor name is a dotted module path (``model.layers.0.mlp.up_proj.weight``): no
# slashes, "..", spaces or control characters.
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)*")


def open_safetensors(file: Path, error: type[StropError] = ModelError) -> Any:
    """A ``safe_open`` handle on ``file`` whose header has been checked; else ``error``.

    safetensors itself rejects malformed header JSON, unknown dtypes, negative dims and
    data offsets that overlap or run past the end of the file. On top of that, every
    tensor name must be a dotted module path and every dtype one of ``WEIGHT_DTYPES``.
    Nothing but the header is read: tensors stay memory-mapped until asked for.
    """
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
    except OSError as err:
        raise error(f"{file}: cannot read ({err.strerror or err})") from None
    if len(head) < 8:
        raise error(f"{file}: not a safetensors file ({size} bytes; too short for a header)")
    # The 8-byte little-endian header length is read here, before safe_open, only to cap
    # it at MAX_HEADER_BYTES (safetensors would parse up to 100 MB of JSON first).
    (header_bytes,) = struct.unpack("<Q", head)
    if header_bytes > size - 8:
        raise error(
            f"{file}: safetensors header claims {header_bytes} bytes, more than the file "
            f"holds ({size} bytes); the file is truncated or not safetensors"
        )
    if header_bytes > MAX_HEADER_BYTES:
        raise error(
            f"{file}: safetensors header of {header_bytes} bytes exceeds strop's limit of "
            f"{MAX_HEADER_BYTES} bytes"
        )
    try:
        handle = safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as err:
        raise error(f"{file}: not a valid safetensors file ({err})") from None
    for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
        if not _TENSOR_NAME.fullmatch(name):
            raise error(f"{file}: tensor name {shown_name(name)} is not a dotted module path")
        dtype = handle.get_slice(name).get_dtype()
        if dtype not in WEIGHT_DTYPES:
            raise error(
                f"{file}: tensor {shown_name(name)} has dtype {dtype}; weights must be one "
                f"of {', '.join(WEIGHT_DTYPES)}"
            )
    return handle


class SafetensorsReader:
    """Read tensors by name from a checkpoint directory, one tensor at a time, as numpy.

    Handles a single ``model.safetensors`` and a sharded ``model.safetensors.index.json``.
    Every file's header is checked when the reader is made (see :func:`open_safetensors`);
    tensors are memory-mapped by safetensors, so reading one does not load the others.
    """

    def __init__(self, path: str | os.PathLike):
        self.directory = Path(path)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        index_path = self.directory / WEIGHTS_INDEX_FILE
        single_path = self.directory / SINGLE_WEIGHTS_FILE
        if index_path.is_file():
            self._file_of = _read_index(index_path)
            for file in sorted(set(self._file_of.values())):
                stored = set(self._open(file).keys())
                absent = sorted(
                    n for n, f in self._file_of.items() if f == file and n not in stored
                )
                if absent:
                    raise ModelError(
                        f"{index_path}: maps {shown_name(absent[0])} to {file.name}, which "
                        f"does not hold it ({len(absent)} such tensors)"
                    )
        elif single_path.is_file():
            for name in self._open(single_path).keys():  # noqa: SIM118 (safe_open has no __iter__)
                self._file_of[name] = single_path
        else:
            pickles = [n for n in PICKLE_WEIGHTS_FILES if (self.directory / n).is_file()]
            found = f"found {pickles[0]}, but " if pickles else ""
            raise ModelError(
                f"{self.directory}: no {SINGLE_WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}; {found}"
                "strop reads weights only from safetensors (pickle files can run code); "
                "convert the checkpoint to safetensors with a loader you trust"
            )

    def _open(self, file: Path) -> Any:
        """The (cached, header-checked) safetensors handle of ``file``."""
        if file not in self._handles:
            self._handles[file] = open_safetensors(file, ModelError)
        return self._handles[file]

    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``, read from the header only."""
        return tuple(self._open(self._file_of[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored safetensors dtype of ``name`` (``F32``, ``BF16``, ...), from the header."""
        return self._open(self._file_of[name]).get_slice(name).get_dtype()

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a host numpy array (bfloat16 as ``ml_dtypes.bfloat16``).

        A floating-point tensor holding NaN or Inf is refused (:class:`ModelError` naming
        it): no training or sampling can be right from such weights, and without this the
        run would stop later at a non-finite loss, blamed on the data or learning rate.
        """
        try:
            array = self._open(self._file_of[name]).get_tensor(name)
        except SafetensorError as err:
            raise ModelError(
                f"{self._file_of[name]}: cannot read tensor {shown_name(name)} ({err})"
            ) from None
        bad = _count_nonfinite(array)
        if bad:
            raise ModelError(
                f"{self._file_of[name]}: tensor {shown_name(name)} holds {bad} NaN/Inf "
                f"value(s) of {array.size}; the checkpoint is damaged: export or download "
                "it again"
            )
        return array


def _count_nonfinite(array: np.ndarray) -> int:
    """How many entries of a floating-point ``array`` are NaN or Inf (0 for integers;
    ``ml_dtypes`` floats such as bfloat16 have numpy kind ``V``)."""
    if array.dtype.kind not in "fV":
        return 0
    try:
        finite = np.isfinite(array)
    except TypeError:  # a void dtype that is no float
        return 0
    return int(array.size - np.count_nonzero(finite))


def _read_index(index_path: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from ``model.safetensors.index.json``, every file a plain
    name in the same directory."""
    index = read_json(index_path, ModelError)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelError(f'{index_path}: needs a non-empty "weight_map" object')
    files = {}
    directory = index_path.parent
    for name, file_name in weight_map.items():
        if not _TENSOR_NAME.fullmatch(name):
            raise ModelError(
                f"{index_path}: tensor name {shown_name(name)} is not a dotted module path"
            )
        if (
            not isinstance(file_name, str)
            or Path(file_name).name != file_name
            or file_name in ("", ".", "..")
            or "\\" in file_name
            or not file_name.endswith(".safetensors")
        ):
            raise ModelError(
                f"{index_path}: {shown_name(name)} maps to {shown_name(str(file_name))}; "
                "shards must be .safetensors files in the same directory"
            )
        if not (directory / file_name).is_file():
            raise ModelError(f"{index_path}: names a missing file {shown_name(file_name)}")
        files[name] = directory / file_name
    return files


def open_checkpoint(path: str | os.PathLike) -> tuple[ModelSpec, SafetensorsReader]:
    """The spec and a header-checked reader of the checkpoint directory ``path``.

    Before any backend builds a model from the spec, the two must plausibly agree: the
    embedding has the shape config.json implies and there are at least as many tensors
    as layers, so a config.json claiming a huge model over small weights is refused
    before anything is built or allocated.
    """
    spec = read_model_spec(path)
    reader = SafetensorsReader(path)
    embed = "model.embed_tokens.weight"
    expected = (spec.vocab_size, spec.hidden_size)
    if embed not in reader:
        raise ModelError(f"{reader.directory}: weights do not match config.json; no {embed}")
    if reader.shape(embed) != expected:
        raise ModelError(
            f"{reader.directory}: tensor {embed!r} has shape {list(reader.shape(embed))}, "
            f"config.json implies {list(expected)}"
        )
    if spec.num_layers > len(reader.names()):
        raise ModelError(
            f"{reader.directory}: config.json says num_hidden_layers={spec.num_layers}, but "
            f"the weights hold only {len(reader.names())} tensors"
        )
    return spec, reader


def check_tensors(
    reader: SafetensorsReader, expected: Mapping[str, tuple[int, ...]], *, tied: bool
) -> None:
    """Raise a :class:`ModelError` unless the checkpoint holds exactly the ``expected``
    tensors (name -> shape), read from the headers only: call it before allocating."""
    present = set(reader.names())
    ignorable = {n for n in present if n.endswith(_DERIVED_SUFFIXES)}
    if tied:
        ignorable.add("lm_head.weight")  # some tied checkpoints store the copy anyway
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected) - ignorable)
    if missing or unexpected:

        def listing(names: list[str]) -> str:
            shown = ", ".join(shown_name(n, 60).strip("'") for n in names[:8])
            return shown + (f", ... ({len(names)} in all)" if len(names) > 8 else "")

        problems = []
        if missing:
            problems.append(f"missing tensors: {listing(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {listing(unexpected)}")
        raise ModelError(
            f"{reader.directory}: weights do not match config.json; {'; '.join(problems)}"
        )
    for name, shape in expected.items():
        stored = reader.shape(name)
        if stored != tuple(shape):
            raise ModelError(
                f"{reader.directory}: tensor {name!r} has shape {list(stored)}, "
                f"config.json implies {list(shape)}"
            )


def write_checkpoint(
    path: str | os.PathLike,
    hf_config: dict[str, Any],
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    dtype_name: str,
    source_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    overwrite: bool = False,
) -> Path:
    """Write a HF checkpoint directory that ``transformers`` loads.

    ``tensors`` is consumed once, in order; shards hold at most ``max_shard_bytes`` each
    (a sharded checkpoint gets ``model.safetensors.index.json``). The directory appears
    only when complete: everything is written to a temporary sibling that is then renamed.
    Tokenizer and generation files found in ``source_dir`` are copied along.
    """
    target = Path(path)
    with (
        writing("the model", target),
        atomic_directory(target, overwrite=overwrite) as staging,
    ):
        _write_shards(staging, tensors, max_shard_bytes)
        config = dict(hf_config)
        config["dtype"] = dtype_name
        config.pop("torch_dtype", None)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if source_dir is not None:
            for name in SIDECAR_FILES:
                if (Path(source_dir) / name).is_file():
                    shutil.copy2(Path(source_dir) / name, staging / name)
    return target


def write_checkpoint_once(
    path: str | os.PathLike,
    hf_config: dict[str, Any],
    tensors: Iterator[tuple[str, np.ndarray]],
    *,
    is_main: bool,
    write_once: Callable[[Callable[[], object], str], None],
    **options: Any,
) -> Path:
    """:func:`write_checkpoint` in a run of several processes: every process iterates
    ``tensors`` (each step may gather a sharded weight, a collective), the main process
    writes them, and ``write_once`` (the backend's) returns in every process once the
    directory is complete. A failed write still iterates to the end, so that the other
    processes' gathers finish and the failure reaches them."""

    def write() -> None:
        try:
            write_checkpoint(path, hf_config, tensors, **options)
        finally:
            for _ in tensors:  # stay in step with the other processes' gathers
                pass

    if not is_main:
        for _ in tensors:
            pass
    write_once(write, f"writing the model {path}")
    return Path(path)


def _write_shards(
    directory: Path, tensors: Iterable[tuple[str, np.ndarray]], max_shard_bytes: int
) -> None:
    """Group tensors into shards of at most ``max_shard_bytes`` and write them."""
    groups: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    for name, array in tensors:
        if groups[-1] and sizes[-1] + array.nbytes > max_shard_bytes:
            groups.append({})
            sizes.append(0)
        groups[-1][name] = np.ascontiguousarray(array)
        sizes[-1] += array.nbytes
    if len(groups) == 1:
        save_file(groups[0], str(directory / SINGLE_WEIGHTS_FILE), metadata={"format": "pt"})
        return
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file_name, group in zip(names, groups, strict=True):
        save_file(group, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file_name))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
