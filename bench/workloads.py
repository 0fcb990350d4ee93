"""The training states the benchmarks checkpoint: the sweep's (``build_state``), the sharded
part's (``sharded_state``), the training loop's and the GPU benchmark's; described in
docs/performance.md, "What runs"."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

WIDTH = 2048
_WIDTHS = (2048, 1024, 512, 256, 128)
_MIN_LAYERS = 4


def layer_bytes(width: int = WIDTH, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one ``Linear(width, width)`` adds: weight, bias, both Adam moments, step counters."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 3 * itemsize * (width * width + width) + 2 * 4


def width_for(size_gb: float, dtype: torch.dtype = torch.float32) -> int:
    """The widest layer that still gives ``size_gb`` a few layers (2048 from ~200 MB)."""
    return next((w for w in _WIDTHS if _MIN_LAYERS * layer_bytes(w, dtype) <= size_gb * 1e9),
                _WIDTHS[-1])


def build_state(size_gb: float, dtype: torch.dtype = torch.float32,
                width: Optional[int] = None) -> tuple[dict, int]:
    """``({"model", "optimizer"}, tensor bytes)`` of about ``size_gb`` GB, after one real step so
    that the Adam moments exist."""
    model, width = mlp(size_gb, dtype, width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _first_step(model, optimizer, width, dtype)
    state = {"model": model, "optimizer": optimizer}
    return state, tensor_bytes(state)


def mlp(size_gb: float, dtype: torch.dtype = torch.float32,
        width: Optional[int] = None) -> tuple[torch.nn.Sequential, int]:
    """Linear + ReLU layers of about ``size_gb`` GB with their optimizer state, and their width;
    seeded: the same on every rank."""
    torch.manual_seed(0)
    width = width_for(size_gb, dtype) if width is None else width
    layers = max(1, round(size_gb * 1e9 / layer_bytes(width, dtype)))
    model = torch.nn.Sequential(*[m for _ in range(layers)
                                  for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    return model.to(dtype), width


def _first_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, width: int,
                dtype: torch.dtype = torch.float32) -> None:
    """One real step: the optimizer's moments exist from here on."""
    model(torch.randn(8, width, dtype=dtype)).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class AppState:
    """DCP's ``Stateful`` pattern for FSDP2 (PyTorch's checkpoint tutorial; a user of the engine
    writes the same, as examples/train_fsdp.py does): model and optimizer through
    ``get_state_dict``/``set_state_dict``, as DTensors, for every system alike."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def sharded_state(size_gb: float, world: int) -> tuple[dict, int]:
    """``{"app": AppState}`` of ``mlp(size_gb)`` ``fully_shard``-ed over ``world`` ranks, with
    AdamW after one step, and the bytes of this rank's share of it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model, width = mlp(size_gb)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _first_step(model, optimizer, width)
    tensors = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values()
                                      if isinstance(t, torch.Tensor))]
    own = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)
    return {"app": AppState(model, optimizer)}, own


def tensor_bytes(state: dict) -> int:
    """Bytes of the state's model and optimizer tensors."""
    return sum(t.nbytes for t in state_tensors(state))


def state_tensors(state: dict) -> list[torch.Tensor]:
    """The model's and optimizer's tensors in a fixed order, for bit-exact comparisons."""
    model, optimizer = state["model"], state["optimizer"]
    tensors = list(model.state_dict(keep_vars=True).values())
    for param_state in optimizer.state.values():
        tensors += [t for _, t in sorted(param_state.items()) if isinstance(t, torch.Tensor)]
    return [t.detach() for t in tensors]


class Workload:
    """A state's bytes and tensor copies: every run starts from the same values, and a restore is
    compared with them bit for bit. Subclasses set ``state`` and ``step()``."""

    state: dict

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.state)

    def clone_tensors(self) -> list[torch.Tensor]:
        return [t.clone() for t in state_tensors(self.state)]

    def load_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Copy a ``clone_tensors()`` back into the state."""
        current = state_tensors(self.state)
        if len(current) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors for a state of {len(current)}")
        with torch.no_grad():
            for dst, src in zip(current, tensors):
                dst.copy_(src)

    def differing_tensors(self, expected: list[torch.Tensor]) -> int:
        """How many state tensors differ bit for bit from a ``clone_tensors()``."""
        current = state_tensors(self.state)
        if len(current) != len(expected):
            return max(len(current), len(expected))
        return sum(not _bit_equal(a, b) for a, b in zip(current, expected))


class TrainingWorkload(Workload):
    """The training loop's MLP + AdamW on one fixed batch: data loading is not what is measured."""

    def __init__(self, width: int = 1024, depth: int = 8, batch: int = 16, seed: int = 0):
        torch.manual_seed(seed)
        blocks = [(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(depth)]
        self.model = torch.nn.Sequential(*[m for block in blocks for m in block])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, width)
        self.y = torch.randn(batch, width)
        self.state = {"model": self.model, "optimizer": self.optimizer}
        self.step()  # the AdamW moments exist from here on

    def step(self) -> float:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.item()


class TransformerWorkload(Workload):
    """The GPU benchmark's bf16 transformer + fused AdamW (state = 3x ``params_gb``), one batch."""

    def __init__(self, params_gb: float, width: int, seq: int, batch: int,
                 device: str = "cpu", seed: int = 0):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        block_params = 12 * width * width + 13 * width  # attention 4w², MLP 8w², biases, norms
        self.depth = max(1, round(params_gb * 1e9 / (2 * block_params)))
        layer = dict(d_model=width, nhead=max(1, width // 128), dim_feedforward=4 * width,
                     dropout=0.0, batch_first=True, norm_first=True, device=self.device,
                     dtype=torch.bfloat16)
        self.model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(**layer)
                                           for _ in range(self.depth)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.x = torch.randn(batch, seq, width, device=self.device, dtype=torch.bfloat16)
        self.y = torch.randn(batch, seq, width, device=self.device)
        self.state = {"model": self.model, "optimizer": self.optimizer}
        self.step()  # the AdamW moments exist from here on

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.model.parameters())

    def step(self, before_update: Callable[[], None] = lambda: None) -> None:
        """``before_update()`` is where a checkpoint's fence goes; then waits for the device, as a
        loop that logs its loss every step does."""
        loss = torch.nn.functional.mse_loss(self.model(self.x).float(), self.y)
        loss.backward()
        before_update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.synchronize()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def restore_quietly(engine) -> Optional[int]:
    """``engine.restore()`` without its warning about a state with no data loader (none here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*holds no data position")
        return engine.restore()
