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
from test_torchtitan import init_model_parts, pipeline_step
from dtensor_fp8._compat import dtensor_local

LR = 1e-3
SEQ, BATCH, VOCAB = 32, 2, 2048
MOE_LAYERS = 1
#: the family's model_registry flavor, how many dense layers precede its MoE layers, and how many
#: routed experts the test keeps (None: the config's; Qwen3's debug config has 64 of 768 x 256)
FLAVORS = {"deepseek_v3": ("debugmodel", 1, None), "qwen3": ("debugmodel_moe", 0, 16)}
#: the fewest routed experts torchtitan runs each family with at every layout of the tests (2 and 4
#: ranks; FSDP2, EP 2 x FSDP2 2, EP 4, PP 2 x FSDP2 2): efsdp x ep at most the experts (else
#: fully_shard cuts inside each expert), and at least the router's top-k (DeepSeek-V3 3, Qwen3 8)
FEWEST_EXPERTS = {"deepseek_v3": 4, "qwen3": 8}
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


#: (family, ep, pp, tp, world size, spmd backend) -> the ParallelDims (and meshes) this rank process uses: one set per layout
_PARALLEL_DIMS: dict = {}


class MoERun:
    """One torchtitan training setup of an MoE model on this rank (see the module docstring); with
    ``pp > 1``, a pipeline of ``pp`` stages x FSDP2 through the model spec's ``pipeline_llm`` (it
    splits the meta model into this rank's stage, applies ``parallelize_*`` to it and builds the
    1F1B schedule), trained as the trainer's ``pp_forward_backward_step`` does."""

    def __init__(self, family: str, recipe: str | None, *, ep: int = 1, pp: int = 1, tp: int = 1,
                 ckpt_dir: str | None = None, experts: int | None = None, checkpoint=None,
                 spmd_backend: str = "partial_dtensor"):
        import torchtitan.distributed.parallel_dims as parallel_dims_module
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims, utils as dist_utils

        from dtensor_fp8.integrations.torchtitan import master_weight_adamw

        device = backend_spec(BACKEND).device
        parallel_dims_module.device_type = device
        self.recipe, self.ep, self.pp = recipe, ep, pp
        pipeline = {"pipeline_parallel_degree": pp, "pipeline_parallel_schedule": "1F1B"} if pp > 1 else {}
        # tp: torchtitan's tensor parallelism (with ep == 1 it shards the experts: Shard(1) / Shard(2) on tp);
        # spmd_backend: torchtitan 0.3's default is "spmd_types" (tests/test_torchtitan_spmd_types.py runs it)
        parallelism = ParallelismConfig(spmd_backend=spmd_backend, expert_parallel_degree=ep,
                                        tensor_parallel_degree=tp, **pipeline)
        training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
        dist_utils.set_spmd_backend(spmd_backend)
        key = (family, ep, pp, tp, dist.get_world_size(), spmd_backend)
        if key not in _PARALLEL_DIMS:
            _PARALLEL_DIMS[key] = ParallelDims.from_config(parallelism, dist.get_world_size())
            _PARALLEL_DIMS[key].build_mesh()
        self.dims = _PARALLEL_DIMS[key]
        self.batch_mesh = self.dims.get_mesh("batch")
        spec = model_spec(family, recipe, ep=ep, experts=experts)
        with torch.device("meta"):
            model = spec.model.build()
        self.loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build()
        setup = dict(parallel_dims=self.dims, training=training, parallelism=parallelism,
                     compile_config=CompileConfig(), ac_config=None, dump_folder="")
        if pp > 1:
            self.schedule, self.parts, self.first, self.last = spec.pipelining_fn(
                model, **setup, device=torch.device(device), model_config=spec.model,
                parallelize_fn=spec.parallelize_fn, loss_fn=self.loss_fn)
        else:
            self.parts = [spec.parallelize_fn(model, **setup)]
        self.model = self.parts[0]
        #: what parallelization left FP8: name -> repr of the local tensor's recipe
        self.parallelized = self.fp8_weights()
        torch.manual_seed(0)  # init_weights draws the same values with and without FP8
        init_model_parts(self.parts, device, force_sum_reduction=True)  # gloo has no PREMUL_SUM
        self.optimizers = (default_adamw if recipe is None else master_weight_adamw)(lr=LR).build(model_parts=self.parts)
        register_moe_load_balancing_hook(self.optimizers, self.parts, self.dims)
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                             training_steps=16)
        self.checkpointer = None
        if ckpt_dir is not None:
            # ``checkpoint``: another config (a Hugging Face save or initial load), built with the model's adapter
            self.checkpointer = (checkpoint or CheckpointManager.Config(
                enable=True, folder="checkpoint", interval=1, keep_latest_k=0, last_save_model_only=False)).build(
                dataloader=None, model_parts=self.parts, optimizers=self.optimizers, lr_schedulers=self.schedulers,
                states={}, sd_adapter=spec.state_dict_adapter(spec.model, None) if checkpoint else None,
                base_folder=ckpt_dir)

    def train(self, steps) -> list[float]:
        """Steps over two fixed batches (the loss falls by memorizing them); the global mean loss
        (pipelined: ``schedule.step`` over micro-batches of one sequence)."""
        from torchtitan.distributed import utils as dist_utils

        dp, rank = self.batch_mesh.size(), self.batch_mesh.get_local_rank()
        losses = []
        for step in steps:
            tokens = torch.randint(0, VOCAB, (dp * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step % 2))
            mine = tokens[rank * BATCH:(rank + 1) * BATCH]
            if self.pp > 1:
                losses.append(pipeline_step(self, [(mine[i:i + 1, :-1].contiguous(),) for i in range(BATCH)],
                                            [{"positions": torch.arange(SEQ)[None]}] * BATCH,
                                            [mine[i:i + 1, 1:].contiguous() for i in range(BATCH)], dp * BATCH * SEQ))
                continue
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

    def scales_used(self, p, usage: str) -> torch.Tensor | None:
        """The scale of each expert of ``p``'s ``usage`` plane where its recipe keeps one as scaling
        state (delayed scaling: from its amax history, not from the master alone), gathered over
        ``p``'s mesh in expert order; ``None`` where the scales are a function of the data (or no
        state exists yet: the first quantization seeds them from the data)."""
        from torch.distributed.tensor import DTensor

        state = dtensor_local(p).param_state.scaling.weight.get(usage)
        if state is None:
            return None
        local = state["scale"].reshape(-1, 1)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=(p.shape[0], 1), stride=(1, 1)).full_tensor().reshape(-1)

    def per_expert_quantize(self, p, master: torch.Tensor, usage: str, experts: slice = slice(None)):
        """``usage``'s plane of ``quantize(master)`` with the recipe per expert (what TE's per-expert
        quantize makes), ``master`` being experts ``experts`` of ``p``'s, with the scales ``p``'s
        recipe keeps where it keeps them (:meth:`scales_used`)."""
        scale = self.scales_used(p, usage)
        recipe = d.per_expert(d.RECIPES[self.recipe], master.shape)
        return d.quantize(master, recipe, rowwise=usage == "rowwise", columnwise=usage == "columnwise",
                          scale=None if scale is None else scale[experts]).plane(usage)

    def unlike_per_expert_quantize(self) -> list[str]:
        """Planes of the gathered routed expert weights that differ, as uint8, from
        :meth:`per_expert_quantize` of the gathered master."""
        full, differ = self.full_experts(), []
        for n, p in self.routed().items():
            for usage in dtensor_local(p).planes:
                plane = self.per_expert_quantize(p, full[f"{n}/master"], usage)
                if not (torch.equal(full[f"{n}/{usage}"], plane.data.view(torch.uint8))
                        and torch.equal(full[f"{n}/{usage}_scale"], plane.scale_inv.contiguous().view(torch.uint8))):
                    differ.append(f"{n}/{usage}")
        return differ

    def fsdp_gathered_unlike(self) -> list[str]:
        """One more forward of each model part holding routed experts (no step follows it; a later
        pipeline stage is fed random hidden states), recording the planes each routed experts'
        grouped GEMM reads: what FSDP2 gathered (under EP, over ``efsdp``: this EP rank's experts).
        The planes that differ, as uint8, from :meth:`per_expert_quantize` of those experts of the
        master."""
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.common.moe import GroupedExperts

        from dtensor_fp8.ops.copies import reads_from

        seen, read = {}, 0
        for part in self.parts:
            modules = [m for m in part.modules() if isinstance(m, GroupedExperts)]
            if not modules:
                continue
            for m in modules:
                def spy(*, A, B_t, offs, _seam=m._grouped_mm):
                    q = reads_from(B_t.base)
                    seen[id(q.param_state)] = {u: (p.data.view(torch.uint8).clone(), p.scale_inv.contiguous().view(torch.uint8).clone())
                                               for u, p in q.planes.items()}
                    return _seam(A=A, B_t=B_t, offs=offs)
                m._grouped_mm = spy
            if getattr(part, "tok_embeddings", None) is not None:
                inputs = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
            else:  # a later pipeline stage: hidden states of the experts' model dim
                dim = modules[0].w1_EFD.shape[-1]
                inputs = torch.randn(BATCH, SEQ, dim, generator=torch.Generator().manual_seed(5))
            with torch.no_grad(), dist_utils.get_spmd_context(parallel_dims=self.dims)():
                part(inputs, positions=torch.arange(SEQ).expand(BATCH, SEQ).contiguous())
            for m in modules:
                del m._grouped_mm
            for m in part.modules():  # torchtitan's PP policy keeps them unsharded after the forward
                if isinstance(m, FSDPModule):
                    m.reshard()
        differ = []
        for n, p in self.routed().items():
            planes = seen.pop(id(dtensor_local(p).param_state))
            read += 1
            mesh = p.device_mesh
            ep_rank = mesh.get_local_rank("ep") if "ep" in (mesh.mesh_dim_names or ()) else 0
            master = self.master_of(p).full_tensor()
            mine = slice(ep_rank * (master.shape[0] // self.ep), (ep_rank + 1) * (master.shape[0] // self.ep))
            for usage, (data, scale) in planes.items():
                want = self.per_expert_quantize(p, master[mine], usage, mine)
                if not (torch.equal(data, want.data.view(torch.uint8))
                        and torch.equal(scale, want.scale_inv.contiguous().view(torch.uint8))):
                    differ.append(f"{n}/{usage}")
        assert not seen and read == len(self.routed()), "every routed expert weight was read, once"
        return differ

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Every parameter's local bytes (FP8 planes), every master's and the optimizer state's."""
        return snapshot(self.named_parameters(), self.optimizers, self.master_of)
