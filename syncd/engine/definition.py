"""The model's own definition as evidence: the module type behind every parameter, read from the class a
`config.json` names, built by `transformers` on the meta device (no weights, no memory, no download).

Burn decides how to adapt a tensor by the type of the module that owns it, never by its name (burn-store's
`PyTorchToBurnAdapter`, crates/burn-store/src/adapter.rs); a `.safetensors` file does not store module types.
Where the model's class can be built, this is where they come from: `nn.Linear` (transposed), transformers'
`Conv1D` (already [in, out]), `nn.Embedding`, the norms, convolutions, `nn.MultiheadAttention`, RNNs. A module
whose type is none of these (a model's own class) is Other, left as it is, as Burn's adapters leave a type they
do not know, unless its type's name says it is a norm (LlamaRMSNorm, T5LayerNorm).

The names `save_pretrained` writes are not always the module tree's: transformers 5 reverts its weight
conversions on save (GPT-NeoX's `lm_head` is written `embed_out`), ties weights and stores them once, and the
base model may be saved with or without its prefix. The table is keyed by every one of those module paths.

`transformers` is an optional extra (`pip install 'syncd[transformers]'`): without it, or for a class it
cannot build, the result is None and a note saying why; the module map, the architectures table and the
conventions decide as before. Built once per distinct config (the daemon converts the same model many times).

The build runs in a child process (`serve`), never in syncd's own: a config.json lies in a watched directory,
and one number in it (VideoMAE's image size, ConvNeXt's depths) made a model's `__init__` allocate gigabytes
in plain Python even on the meta device, past the unit's MemoryMax; the module budget only counts modules.
The child imports torch and transformers once (the daemon's own memory stays free of them), builds under a
memory limit and a time limit, and is killed past either: the conversion then goes on without the
definition, with a note. It exits when idle.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import importlib
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import IO, Any

from syncd.adapters import ModelDefinition
from syncd.adapters.model import (
    BATCH_NORM,
    EMBEDDING,
    GROUP_NORM,
    GRU,
    INSTANCE_NORM,
    LAYER_NORM,
    LINEAR,
    LINEAR_IN_OUT,
    LSTM,
    MULTI_HEAD_ATTENTION,
    OTHER,
    PRELU,
    RMS_NORM,
    RNN,
)

_CACHE_SIZE = 16  # distinct configs whose tables are kept (a daemon watches a few models)

# A config.json lies in a watched directory: one saying 10,000 layers took a minute and 1.1 GiB to build, even
# on the meta device (about 1 ms per module). A model of far more modules than the checkpoint has tensors is
# not this checkpoint's, so the build stops there: at most this many modules per tensor, plus an allowance.
MODULES_PER_TENSOR = 8
MODULE_ALLOWANCE = 1000
MAX_TENSORS = 100_000  # the most a checkpoint syncd reads may hold (Burn's reader limit)


def module_budget(tensor_count: int | None) -> int:
    """The most modules built for a checkpoint of `tensor_count` tensors (None: any checkpoint)."""
    tensors = MAX_TENSORS if tensor_count is None else min(tensor_count, MAX_TENSORS)
    return MODULES_PER_TENSOR * tensors + MODULE_ALLOWANCE


def definition_for(
    config: dict[str, Any] | None, tensor_count: int | None = None
) -> tuple[ModelDefinition | None, str | None]:
    """(the module kinds of the model `config` describes, or None; a note when it could not be used).
    `tensor_count`: the checkpoint's, which bounds the model built (`module_budget`)."""
    if not config or os.environ.get("SYNCD_NO_MODEL_DEFINITION"):
        return None, None
    try:
        key = json.dumps(config, sort_keys=True)
    except (TypeError, ValueError):
        return None, "model definition not used: config.json holds values JSON cannot hold again"
    return _cached_definition(key, module_budget(tensor_count))


def _cached_definition(config_json: str, budget: int) -> tuple[ModelDefinition | None, str | None]:
    try:
        return _built_once(config_json, budget)
    except _Transient as exc:  # not kept: the next conversion of this model tries again
        return None, str(exc)


class _Transient(Exception):
    """A build that failed for a reason of the moment (its process killed, or not started)."""


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _built_once(config_json: str, budget: int) -> tuple[ModelDefinition | None, str | None]:
    """The definition or the note why there is none, kept per config; a failure of the moment is raised
    (_Transient), which the cache does not keep (a daemon whose build process the OOM killer took once went
    without the definition of that model until restarted)."""
    reply = _BUILDER.build(config_json, budget)
    if reply.get("transient"):
        raise _Transient(str(reply["note"]))
    if "note" in reply:
        return None, str(reply["note"])
    return ModelDefinition(dict(reply["kinds"]), str(reply["source"]), tuple(reply["written"])), None


# What a build may take beyond the child's own start (torch and transformers imported): a Llama of 32 layers
# takes about 100 MiB on the meta device, Qwen3-MoE 235B (94 layers of 128 experts) 156 MiB; the hostile
# configs above took 0.9-2.9 GiB, and minutes.
BUILD_MEMORY_BYTES = 384 << 20
BUILD_SECONDS = 120.0
IDLE_SECONDS = 60.0  # the child exits after this long without a build (its imports hold ~250 MiB)
# what the child may keep between builds (each family's modeling code, imported once, stays): past it, it exits
RETAINED_BYTES = 512 << 20
_WATCH_SECONDS = 0.1  # how often the child's memory is looked at while it builds
_NOT_INSTALLED = "model definition not used: transformers is not installed (pip install 'syncd[transformers]')"


class _Builder:
    """The child process that builds definitions, one at a time, and syncd's side of its one-line JSON
    requests and replies. Its memory is watched while it builds (and limited from inside where the system
    lets it lower its own limit); past the limit or the time it is killed, and started again for the next."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._last_used = 0.0
        self._refused: dict[str, Any] | None = None  # what a child that could not build said (no transformers)

    def build(self, config_json: str, budget: int) -> dict[str, Any]:
        with self._lock:
            try:
                return self._build(config_json, budget)
            except OSError as exc:  # no process could be started (a task limit): the other evidence decides
                self._stop()
                note = f"model definition not used: cannot start the process building it ({exc.strerror})"
                return {"note": note, "transient": True}

    def _build(self, config_json: str, budget: int) -> dict[str, Any]:
        proc = self._running()
        if isinstance(proc, dict):
            return proc  # it could not start (transformers missing): said by its first line
        assert proc.stdin is not None and proc.stdout is not None
        request = json.dumps({"config": config_json, "budget": budget}) + "\n"
        before = _resident_bytes(proc.pid) or 0
        try:
            proc.stdin.write(request.encode())
            proc.stdin.flush()
        except BrokenPipeError:
            return self._died(proc)
        reply, why = _reply_of(proc, proc.stdout.fileno(), before + BUILD_MEMORY_BYTES, BUILD_SECONDS)
        self._last_used = time.monotonic()
        if reply is None:
            self._stop()
            return {"note": f"model definition not used: building it {why}"}
        if not reply:
            return self._died(proc)
        return dict(json.loads(reply))

    def _running(self) -> subprocess.Popen[bytes] | dict[str, Any]:
        """The child, started if it is not running or may have exited idle meanwhile; or its refusal."""
        if self._refused is not None:
            return self._refused
        proc = self._proc
        if proc is not None and proc.poll() is None and time.monotonic() - self._last_used < IDLE_SECONDS / 2:
            return proc
        self._stop()
        proc = subprocess.Popen(
            # -P and cwd /: nothing imported from the directory syncd was started in (a torch.py in a downloaded
            # model's directory ran with `-c`, which puts the current directory first on the path)
            [sys.executable, "-P", "-c", "from syncd.engine.definition import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # transformers' warnings: not the journal's business
            env=_child_environment(),
            cwd="/",
        )
        # reaped when it exits on its own (idle), not left a zombie until the next build
        threading.Thread(target=proc.wait, name="definition-reaper", daemon=True).start()
        self._proc = proc
        assert proc.stdout is not None
        hello, why = _reply_of(proc, proc.stdout.fileno(), None, BUILD_SECONDS)
        if not hello:
            self._stop()
            note = f"model definition not used: its process did not start ({why or 'it exited'})"
            return {"note": note, "transient": True}
        ready = json.loads(hello)
        if "note" in ready:  # the same for every build of this process: said without starting it again
            self._stop()
            self._refused = dict(ready)
            return self._refused
        self._last_used = time.monotonic()
        return proc

    def _died(self, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        code = proc.wait()
        self._proc = None
        how = f"signal {-code}" if code < 0 else f"status {code}"
        return {"note": f"model definition not used: the process building it died ({how})", "transient": True}

    def stop(self) -> None:
        """Kill the process, without waiting for a build under way to end (at exit: its lock may be held)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


_BUILDER = _Builder()
atexit.register(_BUILDER.stop)  # syncd exiting (SIGTERM, the end of a convert): its build goes with it


def _child_environment() -> dict[str, str]:
    """The child imports this very syncd (a checkout, a snapshot), whatever else the path holds."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else ""), _PARENT_VARIABLE: str(os.getpid())}


def _reply_of(
    proc: subprocess.Popen[bytes], fd: int, max_resident: int | None, seconds: float
) -> tuple[bytes | None, str]:
    """(the child's next line, b"" if it exited first) or (None, why) once it holds more than `max_resident`
    bytes or takes longer than `seconds`."""
    deadline = time.monotonic() + seconds
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, f"took more than {seconds:.0f} s"
        ready, _, _ = select.select([fd], [], [], min(left, _WATCH_SECONDS))
        if ready:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"", ""
            chunks.append(chunk)
            if chunk.endswith(b"\n"):  # (a reply is one line: JSON holds no raw newline)
                return b"".join(chunks), ""
        elif max_resident is not None and (_resident_bytes(proc.pid) or 0) > max_resident:
            return None, f"took more than {BUILD_MEMORY_BYTES >> 20} MiB"


def _resident_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def serve() -> None:
    """The child's loop: one JSON request per line on stdin, one reply per line on the original stdout
    (anything a model prints goes to stderr instead). Exits at EOF, after IDLE_SECONDS without a request, or
    once what its builds left behind (the modeling code of each family, freed memory Python keeps) passes
    RETAINED_BYTES."""
    _die_with_parent()
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:  # transformers first: without it, torch is not worth its import time here
        transformers = importlib.import_module("transformers")
        torch = importlib.import_module("torch")
    except ImportError:
        _say(replies, {"note": _NOT_INSTALLED})
        return
    started = _resident_bytes(os.getpid()) or 0
    _say(replies, {"ready": True})
    while select.select([sys.stdin], [], [], IDLE_SECONDS)[0]:
        line = sys.stdin.buffer.readline()
        if not line:
            break
        request = json.loads(line)
        _limit_own_memory()
        _say(replies, _built(request["config"], int(request["budget"]), transformers, torch))
        if (_resident_bytes(os.getpid()) or 0) > started + RETAINED_BYTES:
            break
    os._exit(0)  # without tearing down torch and transformers, which took seconds of CPU after syncd was gone


def _die_with_parent() -> None:
    """Killed when syncd dies, even by SIGKILL (its watch of the build's memory and time goes with it): the
    kernel's parent-death signal, then a check that the parent was not gone already."""
    parent = int(os.environ.get(_PARENT_VARIABLE, "0"))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # (stdin's end still stops it once a build is over)
    if parent and os.getppid() != parent:
        os._exit(0)


_PR_SET_PDEATHSIG = 1
_PARENT_VARIABLE = "SYNCD_DEFINITION_PARENT"


def _say(replies: IO[bytes], reply: dict[str, Any]) -> None:
    replies.write(json.dumps(reply).encode() + b"\n")
    replies.flush()


def _limit_own_memory() -> None:
    """The data limit set to what the child holds now plus a build's allowance, so an allocation past it
    fails at once (MemoryError) rather than when the parent next looks; where the system refuses (a unit's
    system call filter), the parent's watch alone bounds it."""
    import resource

    try:
        with open("/proc/self/status") as status:
            data = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmData:"))
        _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        wanted = data + BUILD_MEMORY_BYTES
        if hard == resource.RLIM_INFINITY or wanted < hard:
            resource.setrlimit(resource.RLIMIT_DATA, (wanted, hard))
    except (OSError, ValueError, StopIteration):
        pass


def _built(config_json: str, budget: int, transformers: Any, torch: Any) -> dict[str, Any]:
    """One build's reply: the definition's parts, or a note saying why there is none."""
    config = json.loads(config_json)
    try:
        with _at_most(budget, torch):
            model, class_name = _build_on_meta(transformers, torch, config)
        kinds = _saved_module_kinds(model, torch)
        written = _written_names(model)
    except _TooManyModules:
        return {"note": f"model definition not used: config.json describes a model of more than {budget} modules"}
    except MemoryError:
        return {"note": f"model definition not used: building it took more than {BUILD_MEMORY_BYTES >> 20} MiB"}
    except Exception as exc:  # a class transformers cannot build here: the other evidence decides
        text = " ".join(str(exc).split())[:160] or type(exc).__name__
        return {"note": f"model definition not used: transformers cannot build it ({text})"}
    source = f"model definition {class_name} (transformers {transformers.__version__})"
    return {"kinds": kinds, "source": source, "written": list(written)}


def _build_on_meta(transformers: Any, torch: Any, config: dict[str, Any]) -> tuple[Any, str]:
    """The model class `architectures` names (else the base model of `model_type`), its parameters on the meta
    device. The config comes from the parsed config.json, read as its config class reads it (no hub, no
    download); remote code is never run."""
    transformers.logging.set_verbosity_error()
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError("config.json has no model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"transformers {transformers.__version__} has no model type {model_type!r}")
    config_class = transformers.CONFIG_MAPPING[model_type]
    # as the config class reads its own file: floats JSON cannot hold are written {"__float__": "Infinity"}
    decode = getattr(config_class, "_decode_special_floats", None)
    auto_config = config_class.from_dict(decode(config) if decode is not None else config)
    classes = [c for c in config.get("architectures") or [] if isinstance(c, str)]
    model_class = next((found for c in classes if _is_model_class(found := getattr(transformers, c, None))), None)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        if model_class is not None:
            return model_class(auto_config), model_class.__name__
        model = transformers.AutoModel.from_config(auto_config)
        return model, type(model).__name__


class _TooManyModules(Exception):
    pass


_building = threading.local()  # the modules the build in this thread may still register
_hook_lock = threading.Lock()
_hook_registered = False


@contextlib.contextmanager
def _at_most(budget: int, torch: Any) -> Iterator[None]:
    """Stop a build in this thread (raising _TooManyModules) once it registers more than `budget` modules:
    counted by a global module-registration hook of torch, registered once, which counts only in a thread
    that is building here."""
    _register_hook(torch)
    _building.left = budget
    try:
        yield
    finally:
        _building.left = None


def _register_hook(torch: Any) -> None:
    global _hook_registered
    with _hook_lock:
        if not _hook_registered:
            torch.nn.modules.module.register_module_module_registration_hook(_count_module)
            _hook_registered = True


def _count_module(_parent: Any, _name: str, _module: Any) -> None:
    left = getattr(_building, "left", None)
    if left is None:
        return None
    if left <= 0:
        raise _TooManyModules
    _building.left = left - 1
    return None


def _is_model_class(found: Any) -> bool:
    """Only a model class is built: `architectures` comes from a file in a watched directory, and
    transformers exports functions (`pipeline`) that would fetch from the hub if called."""
    from transformers import PreTrainedModel

    return isinstance(found, type) and issubclass(found, PreTrainedModel)


def _saved_module_kinds(model: Any, torch: Any) -> dict[str, str]:
    """Module path -> kind, under the module tree's own paths and the ones save_pretrained writes."""
    own = {path: kind for path, module in model.named_modules() if (kind := module_kind(module, torch)) is not None}
    kinds = dict(own)
    for saved, original in _saved_names(model).items():
        owner = original.rpartition(".")[0]
        if owner in own:
            kinds.setdefault(saved.rpartition(".")[0], own[owner])
    for path in _split_expert_linears(model, torch, own):
        kinds.setdefault(path, LINEAR)
    prefix = getattr(model, "base_model_prefix", "") or ""
    # the base model saved alone drops its prefix, and the reverse: a model with a head saved its base model's
    # paths under the prefix, which the base model built alone (a config.json with no `architectures`) lacks
    if prefix:
        for path, kind in list(kinds.items()):
            other = path.removeprefix(prefix + ".") if path.startswith(prefix + ".") else f"{prefix}.{path}"
            kinds.setdefault(other, kind)
    return kinds


def _saved_names(model: Any) -> dict[str, str]:
    """Name save_pretrained writes -> the model's own name, where transformers renames on save (its weight
    conversions reversed); a tensor it rebuilds (merged or split) maps to nothing."""
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion

        saved = revert_weight_conversion(model, dict(state))
    except Exception:  # older or newer transformers without it: the module tree's names serve
        return {}
    by_identity = {id(value): name for name, value in state.items()}
    return {name: by_identity[id(value)] for name, value in saved.items() if id(value) in by_identity}


def _split_expert_linears(model: Any, torch: Any, own: dict[str, str]) -> list[str]:
    """The saved module paths of the experts' Linear layers that transformers 5 fuses on load and writes back on
    save (Mixtral's `experts.N.w1`/`w2`/`w3`): no module of the tree holds them, so the definition's kinds do
    not reach them. Its weight conversions say which: a converter that merges a ModuleList (`MergeModulelist`)
    of per-expert `.weight`s into a 3-D parameter [experts, out, in] of an experts module, which its forward
    applies with `F.linear`, so each expert's weight, as saved, is an nn.Linear's [out, in] (so in transformers
    5.24 for Mixtral, DeepSeek-V3 and -V4, PhiMoE, MiniMax, MiniMax-M2, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE;
    tests/test_models.py computes Mixtral's and DeepSeek-V4's experts from the converted weights). The saved
    names are the conversions reverted on a state dict of empty tensors of each parameter's
    shape on the meta device (the conversions copy what they move: zeros expanded on the CPU took 24 GiB for a
    Mixtral 8x7B config)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import revert_weight_conversion

        state = model.state_dict()
        probe = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in state.items()}
        saved = list(revert_weight_conversion(model, dict(probe)))
        converters = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # older or newer transformers without these: the other evidence decides
        return []
    merged: list[re.Pattern[str]] = []
    for converter in converters:
        operations = [type(op).__name__ for op in getattr(converter, "operations", None) or []]
        sources, targets = getattr(converter, "source_patterns", []), getattr(converter, "target_patterns", [])
        # a merge, and a concatenation of merges (w1 and w3 into gate_up_proj), moves no element within a
        # weight: anything else (a transpose, a reshape) would make the saved weights other than [out, in]
        if operations[:1] != ["MergeModulelist"] or not set(operations) <= _MERGES or not sources or not targets:
            continue
        fused = [n for n in state if any(isinstance(t, str) and n.endswith(t) for t in targets)]
        if not fused or not all(state[n].dim() == 3 and own.get(n.rpartition(".")[0]) == OTHER for n in fused):
            continue
        merged += [_saved_pattern(pattern) for pattern in sources if isinstance(pattern, str)]
    return sorted({name.rpartition(".")[0] for name in saved if any(p.search(name) for p in merged)})


_MERGES = frozenset({"MergeModulelist", "Concatenate"})


def _saved_pattern(pattern: str) -> re.Pattern[str]:
    """A converter's source pattern (`.experts.*.w1.weight`, or `\\.experts.*.w1.weight` with its dots escaped;
    `*` an expert's index) as a regex over saved names; only `.weight` patterns of literal segments are taken
    (a pattern it cannot read matches nothing)."""
    pattern = pattern.replace("\\.", ".")
    if not pattern.endswith(".weight") or not re.fullmatch(r"[A-Za-z0-9_.*]+", pattern):
        return re.compile(r"(?!)")
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")


def _written_names(model: Any) -> list[str]:
    """The tensor names save_pretrained writes: the state dict under its saved names, less the weights tied to
    another one (`all_tied_weights_keys`: tied -> source), which it stores once, under the source's name."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    state = model.state_dict()
    saved = _saved_names(model) or {name: name for name in state}
    return [name for name, original in saved.items() if not (original in tied and tied[original] in state)]


def module_kind(module: Any, torch: Any) -> str | None:
    """The kind of a module by its type, as Burn's adapters key on a module's type; None for a module without
    parameters or buffers of its own."""
    nn = torch.nn
    if not any(True for _ in module.parameters(recurse=False)) and not any(True for _ in module.buffers(recurse=False)):
        return None
    for torch_class, kind in (
        (nn.MultiheadAttention, MULTI_HEAD_ATTENTION),
        (nn.LSTM, LSTM),
        (nn.GRU, GRU),
        (nn.RNN, RNN),
        (nn.Linear, LINEAR),
        (nn.Embedding, EMBEDDING),
        (nn.modules.batchnorm._BatchNorm, BATCH_NORM),
        (nn.modules.instancenorm._InstanceNorm, INSTANCE_NORM),
        (nn.LayerNorm, LAYER_NORM),
        (nn.GroupNorm, GROUP_NORM),
        (nn.PReLU, PRELU),
    ):
        if isinstance(module, torch_class):
            return kind
    if isinstance(module, getattr(nn, "RMSNorm", ())):
        return RMS_NORM
    if isinstance(module, nn.modules.conv._ConvNd):
        return type_name_of_conv(module, nn)
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers."):
        return LINEAR_IN_OUT  # GPT-2's Conv1D: a Linear whose weight is stored [in, out]
    if _applies_its_weight_as_a_linear(module):
        return LINEAR
    return _named_norm(module)


def _applies_its_weight_as_a_linear(module: Any) -> bool:
    """A model's own class that is an nn.Linear in all but its type: a 2-D `weight` (and a bias of its rows)
    that its forward passes whole to `linear` (transformers 5's mixture-of-experts routers, MixtralTopKRouter:
    `F.linear(hidden_states, self.weight)`, an nn.Linear in transformers 4 and in a Burn port), cast to
    another dtype at most. A weight transposed, scaled or sliced on the way is not passed whole, and the
    module stays Other."""
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or weight.dim() != 2 or set(params) - {"weight", "bias"}:
        return False
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return False
    return _forward_passes_its_weight_to_linear(module.__class__)


# `linear(<first argument, one level of parentheses>, self.weight` then `,` or `)`: the weight as it is, or
# cast (`.type(torch.float32)`, `.float()`, `.to(dtype)`: its elements converted, its layout the same)
_LINEAR_OF_OWN_WEIGHT = re.compile(
    r"\blinear\((?:[^()]|\([^()]*\))*?,\s*self\.weight"
    r"(?:\.(?:type|to)\([^()]*\)|\.(?:float|half|bfloat16|double)\(\))?\s*[,)]"
)


@functools.cache
def _forward_passes_its_weight_to_linear(cls: Any) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return _LINEAR_OF_OWN_WEIGHT.search(source) is not None


def type_name_of_conv(module: Any, nn: Any) -> str | None:
    for torch_class in (
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
    ):
        if isinstance(module, torch_class):
            return torch_class.__name__
    return None


def _named_norm(module: Any) -> str:
    """A model's own class: a norm when its type's name says so (LlamaRMSNorm, T5LayerNorm, MobileBERT's NoNorm,
    Mamba2's MambaRMSNormGated): an RmsNorm with a weight and no bias, a LayerNorm with both. Any other type
    is one Burn's adapters do not know, so they leave its tensors as they are: Other."""
    params = {leaf for leaf, _ in module.named_parameters(recurse=False)}
    if "norm" in type(module).__name__.lower():
        if params == {"weight"}:
            return RMS_NORM
        if params == {"weight", "bias"}:
            return LAYER_NORM
    return OTHER
