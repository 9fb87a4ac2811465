"""torchtitan 0.3's MoE models with FP8 routed experts, set up on each rank as torchtitan's trainer
sets them up (tests/test_torchtitan.py's module docstring says what differs from the trainer and
why): the model config from the family's ``model_registry`` with ``FP8ParameterConverter(targets=
"experts")`` (or none: the run with bf16 experts), its sharding config, the meta build, its
``parallelize_*`` (FSDP2; expert parallelism over torchtitan's ``ep`` mesh dim with FSDP2 over
``efsdp`` in the EP region), ``to_empty``, ``init_weights``, the optimizers container, LR schedulers,
loss, MoE load-balancing hook and DCP ``CheckpointManager``.

The models are cut short for test time: the first ``MOE_LAYERS`` MoE layers (DeepSeek-V3's dense
first layer kept), sequences of ``SEQ`` tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import dtensor_fp8 as d
from dist_utils import BACKEND, backend_spec
from fp8_snapshot import as_bytes, differing, snapshot  # noqa: F401  (as_bytes, differing: re-exported to the MoE tests)
from dtensor_fp8._compat import dtensor_local

LR = 1e-3
SEQ, BATCH, VOCAB = 32, 2, 2048
MOE_LAYERS = 1
#: the family's model_registry flavor, how many dense layers precede its MoE layers, and how many
#: routed experts the test keeps (None: the config's; Qwen3's debug config has 64 of 768 x 256)
FLAVORS = {"deepseek_v3": ("debugmodel", 1, None), "qwen3": ("debugmodel_moe", 0, 16)}
#: the routed experts' weights in a parameter name
ROUTED = "routed_experts.inner_experts.w"


def model_spec(family: str, recipe: str | None, *, ep: int = 1, moe_layers: int = MOE_LAYERS, experts: int | None = None):
    """The family's debug MoE model spec through its ``model_registry`` (with the converter when
    ``recipe``), its config cut to ``moe_layers`` MoE layers, with torchtitan's CPU attention and
    its sharding config (expert parallelism on when ``ep > 1``); ``experts`` routed experts if given."""
    import importlib

    from torchtitan.models.common.attention import ScaledDotProductAttention

    from dtensor_fp8.integrations.torchtitan import FP8ParameterConverter

    models = importlib.import_module(f"torchtitan.models.{family}")
    sharding = importlib.import_module(f"torchtitan.models.{family}.sharding")
    flavor, dense, kept = FLAVORS[family]
    experts = experts or kept
    converters = None if recipe is None else [FP8ParameterConverter.Config(recipe=recipe, targets="experts",
                                                                           filter_fqns=["lm_head", "router"])]
    spec = models.model_registry(flavor, converters=converters)
    config = spec.model
    config.layers = config.layers[:dense + moe_layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if experts is not None and getattr(layer, "moe", None) is not None:
            _keep_experts(layer.moe, experts)
    getattr(sharding, f"set_{family}_sharding_config")(config, enable_sp=False, enable_ep=ep > 1)
    return spec


def _keep_experts(moe, n: int) -> None:
    """The MoE layer config ``moe`` with ``n`` routed experts (test time; routing and shapes kept)."""
    routed = moe.routed_experts
    for config in (moe, moe.router, routed.inner_experts, routed.token_dispatcher):
        config.num_experts = n
    moe.router.gate.out_features = n


#: (family, ep, world size, spmd backend) -> the ParallelDims (and meshes) this rank process uses: one set per layout
_PARALLEL_DIMS: dict = {}


class MoERun:
    """One torchtitan training setup of an MoE model on this rank (see the module docstring)."""

    def __init__(self, family: str, recipe: str | None, *, ep: int = 1, ckpt_dir: str | None = None,
                 experts: int | None = None, spmd_backend: str = "partial_dtensor"):
        import torchtitan.distributed.parallel_dims as parallel_dims_module
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims, utils as dist_utils

        from dtensor_fp8.integrations.torchtitan import master_weight_adamw

        device = backend_spec(BACKEND).device
        parallel_dims_module.device_type = device
        self.recipe, self.ep = recipe, ep
        # spmd_backend: torchtitan 0.3's default is "spmd_types" (tests/test_torchtitan_spmd_types.py runs it)
        parallelism = ParallelismConfig(spmd_backend=spmd_backend, expert_parallel_degree=ep)
        training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
        dist_utils.set_spmd_backend(spmd_backend)
        key = (family, ep, dist.get_world_size(), spmd_backend)
        if key not in _PARALLEL_DIMS:
            _PARALLEL_DIMS[key] = ParallelDims.from_config(parallelism, dist.get_world_size())
            _PARALLEL_DIMS[key].build_mesh()
        self.dims = _PARALLEL_DIMS[key]
        self.batch_mesh = self.dims.get_mesh("batch")
        spec = model_spec(family, recipe, ep=ep, experts=experts)
        with torch.device("meta"):
            model = spec.model.build()
        model = spec.parallelize_fn(model, parallel_dims=self.dims, training=training, parallelism=parallelism,
                            compile_config=CompileConfig(), ac_config=None, dump_folder="")
        #: what parallelization left FP8: name -> repr of the local tensor's recipe
        self.parallelized = self.fp8_weights(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (tests/test_torchtitan.py)
        model.to_empty(device=device)
        torch.manual_seed(0)  # init_weights draws the same values with and without FP8
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        self.model = model
        self.parts = [model]
        self.optimizers = (default_adamw if recipe is None else master_weight_adamw)(lr=LR).build(model_parts=[model])
        register_moe_load_balancing_hook(self.optimizers, [model], self.dims)
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                             training_steps=16)
        self.loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build()
        self.checkpointer = None
        if ckpt_dir is not None:
            self.checkpointer = CheckpointManager.Config(
                enable=True, folder="checkpoint", interval=1, keep_latest_k=0, last_save_model_only=False).build(
                dataloader=None, model_parts=[model], optimizers=self.optimizers, lr_schedulers=self.schedulers,
                states={}, sd_adapter=None, base_folder=ckpt_dir)

    def train(self, steps) -> list[float]:
        """Steps over two fixed batches (the loss falls by memorizing them); the global mean loss."""
        from torchtitan.distributed import utils as dist_utils

        dp, rank = self.batch_mesh.size(), self.batch_mesh.get_local_rank()
        losses = []
        for step in steps:
            tokens = torch.randint(0, VOCAB, (dp * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step % 2))
            mine = tokens[rank * BATCH:(rank + 1) * BATCH]
            with dist_utils.get_spmd_context(parallel_dims=self.dims)():
                logits = self.model(mine[:, :-1].contiguous(), positions=torch.arange(SEQ).expand(BATCH, SEQ).contiguous())
                loss, _ = self.loss_fn(logits, mine[:, 1:].contiguous(), torch.tensor(float(dp * BATCH * SEQ)))
                loss.backward()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total, group=self.batch_mesh.get_group())
            losses.append(total.item())
        return losses

    def named_parameters(self) -> list:
        """The parameters of every model part on this rank (one part unless pipelined)."""
        return [item for part in self.parts for item in part.named_parameters()]

    def fp8_weights(self, model=None) -> dict[str, str]:
        """Name -> recipe repr of every parameter whose local tensor is FP8 (of ``model``, or of
        every model part)."""
        named = self.named_parameters() if model is None else model.named_parameters()
        return {n: repr(dtensor_local(p).recipe) for n, p in named if isinstance(dtensor_local(p), d.QuantizedTensor)}

    def routed(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if ROUTED in n}

    def master_of(self, param):
        for optimizer in self.optimizers.optimizers:
            master = optimizer.master_of(param)
            if master is not None:
                return master
        raise AssertionError("no master")

    def full_experts(self) -> dict[str, torch.Tensor]:
        """Every routed expert weight gathered from all ranks: its stored planes' bytes and scales
        (one direction at a time, ``for_usage``) and its fp32 master, keyed ``name/plane``."""
        out = {}
        for n, p in self.routed().items():
            local = dtensor_local(p)
            for usage in local.planes:
                plane = d.for_usage(p, usage).full_tensor().plane(usage)
                out[f"{n}/{usage}"] = plane.data.view(torch.uint8).clone()
                out[f"{n}/{usage}_scale"] = plane.scale_inv.contiguous().view(torch.uint8).clone()
            out[f"{n}/master"] = self.master_of(p).full_tensor().detach().clone()
        return out

    def unlike_per_expert_quantize(self) -> list[str]:
        """Planes of the gathered routed expert weights that differ, as uint8, from ``quantize`` of
        the gathered master with the recipe per expert (what TE's per-expert quantize makes)."""
        full, differ = self.full_experts(), []
        recipe = d.RECIPES[self.recipe]
        for n in self.routed():
            master = full[f"{n}/master"]
            want = d.quantize(master, d.per_expert(recipe, master.shape))
            for usage, plane in want.planes.items():
                if not (torch.equal(full[f"{n}/{usage}"], plane.data.view(torch.uint8))
                        and torch.equal(full[f"{n}/{usage}_scale"], plane.scale_inv.contiguous().view(torch.uint8))):
                    differ.append(f"{n}/{usage}")
        return differ

    def fsdp_gathered_unlike(self) -> list[str]:
        """One more forward (no step follows it), recording the planes each routed experts' grouped
        GEMM reads: what FSDP2 gathered (under EP, over ``efsdp``: this EP rank's experts). The
        planes that differ, as uint8, from per-expert ``quantize`` of those experts of the master."""
        from torchtitan.models.common.moe import GroupedExperts

        from dtensor_fp8.ops.copies import reads_from

        seen = {}
        modules = [m for m in self.model.modules() if isinstance(m, GroupedExperts)]
        for m in modules:
            def spy(*, A, B_t, offs, _seam=m._grouped_mm):
                q = reads_from(B_t.base)
                seen[id(q.param_state)] = {u: (p.data.view(torch.uint8).clone(), p.scale_inv.contiguous().view(torch.uint8).clone())
                                           for u, p in q.planes.items()}
                return _seam(A=A, B_t=B_t, offs=offs)
            m._grouped_mm = spy
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
        from torchtitan.distributed import utils as dist_utils

        with torch.no_grad(), dist_utils.get_spmd_context(parallel_dims=self.dims)():
            self.model(tokens, positions=torch.arange(SEQ).expand(BATCH, SEQ).contiguous())
        for m in modules:
            del m._grouped_mm
        recipe, differ = d.RECIPES[self.recipe], []
        for n, p in self.routed().items():
            planes = seen.pop(id(dtensor_local(p).param_state))
            mesh = p.device_mesh
            ep_rank = mesh.get_local_rank("ep") if "ep" in (mesh.mesh_dim_names or ()) else 0
            master = self.master_of(p).full_tensor()
            mine = master[ep_rank * (master.shape[0] // self.ep):(ep_rank + 1) * (master.shape[0] // self.ep)]
            want = d.quantize(mine, d.per_expert(recipe, mine.shape)).planes
            for usage, (data, scale) in planes.items():
                if not (torch.equal(data, want[usage].data.view(torch.uint8))
                        and torch.equal(scale, want[usage].scale_inv.contiguous().view(torch.uint8))):
                    differ.append(f"{n}/{usage}")
        assert not seen and planes, "every routed expert weight was read"
        return differ

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Every parameter's local bytes (FP8 planes), every master's and the optimizer state's."""
        return snapshot(self.named_parameters(), self.optimizers, self.master_of)
