//! The training-step graph: forward, backward and optimizer update of one step as one IR
//! graph, so that data parallelism, ZeRO and pipelines can later be expressed as
//! transformations of it.
//!
//! [`build_train_step`] takes a forward graph built at the *micro-batch* size, with a scalar
//! `loss` output, and returns a graph that is a pure function from the training state and a
//! global batch to the next state:
//!
//! - **State** is held in `parameter` nodes, so that `init_parameters` of the runtime gives a
//!   correct initial state: the fp32 master weights under their model names, and the
//!   optimizer state (fp32, zero-initialised) named after them ([`momentum_name`],
//!   [`adam_m_name`], [`adam_v_name`], [`STEP_COUNT`], [`LOSS_SCALE`], [`GOOD_STEPS`]).
//!   Every state value has a graph output *of the same name* holding its next value, so a
//!   driver feeds outputs back by name. [`TrainStep`] lists which state is which.
//! - **Data inputs** keep their names and roles with the global batch (`m` micro-batches of
//!   the forward's batch) on dim 0, which every input of the forward must have first.
//! - **Outputs** besides the state: `loss` (the mean of the micro-batch losses, which for
//!   equal micro-batches is the loss of the whole batch), [`GRAD_NORM`] (the global gradient
//!   norm before clipping) and, with loss scaling, [`GRADS_FINITE`].
//!
//! # Gradient accumulation
//!
//! Micro-batch `k` takes rows `k, k+m, k+2m, ...` of every data input (so that splitting the
//! batch over data-parallel ranks in contiguous blocks splits each micro-batch alike, and no
//! rank needs another's rows) and runs a copy of the
//! forward whose nodes are scoped `mb{k}/<forward scope>`; its backward follows at once
//! (`mb{k}/grad/...`, seeded with `1/m` so that the sum of the micro-batch gradients is the
//! gradient of the mean loss), then its gradients are added to the running sums in fp32
//! (`mb{k}/accumulate/<parameter scope>`). MoE capacity is per micro-batch, as the forward
//! graph fixes it.
//!
//! # Metadata
//!
//! What later passes read is each node's [`NodeMeta`], never the scopes above (provenance for
//! dumps): micro-batch `k`'s forward copies keep their forward node's layer and part with
//! `phase=forward, mb=k`; its backward gets `phase=backward, mb=k` (autodiff keeps the
//! forward node's layer and part; the seed has none); the gradient sums `phase=accumulate, mb=k` with
//! their weight's layer; the mean of the losses `phase=accumulate` and no micro-batch; the
//! optimizer (state, updates, norm, clipping, loss scale) `phase=optimizer`, with the weight's
//! layer where it is per weight. The copied parameters and inputs keep the forward's
//! metadata (layer, weight role); the optimizer state gets its weight's layer, no role and,
//! like every parameter and input, no phase.
//!
//! # Mixed precision
//!
//! With a compute dtype of bf16 or f16 every micro-batch casts the fp32 master weights (and
//! float data inputs) to it, float constants and casts of the forward take it, and the
//! logits are cast back to f32 before the cross-entropy. Gradients flow back through the
//! casts, so they reach the master weights in fp32; accumulation, clipping and the optimizer
//! run in fp32.
//!
//! With [`LossScaling`] (meant for f16) the seed is multiplied by the loss scale, the
//! gradients are divided by it, and a step whose gradients are not finite (detected as
//! `x - x != 0` on their sum of squares) keeps the previous state through `select`: weights,
//! optimizer state and step count. The scale is halved after such a step and doubled after
//! `growth_interval` finite steps in a row. It is stored relative to `initial_scale` (the
//! state starts at 1), so the state's initialisation stays the generic `ones`.
//!
//! # Optimizer
//!
//! Gradients are clipped to a global norm ([`TrainOptions::clip_norm`]), then every weight
//! goes through `sgd_update` (momentum) or `adamw_update` (bias correction with the 1-based
//! step count, decoupled weight decay on every weight). The learning rate is an attribute of
//! those ops, so it is fixed per built graph. Optimizer nodes are scoped
//! `optimizer/<parameter scope>`.
//!
//! # Execution order
//!
//! Node ids encode the order in which the interpreter runs the step (see [`order`]): per
//! micro-batch forward then backward, `saved/` values computed in the forward, recomputed
//! ones just before their use.

pub mod order;

mod optimizer;

use std::collections::{HashMap, HashSet};

use autopar_ir::{DType, Graph, NodeMeta, Op, Phase, TensorType, ValueId, verify};

pub use order::{RECOMPUTE_TAG, has_tag, sequence};

use crate::autodiff::{self, Emitter};
use crate::error::PassError;
use crate::recompute::{Recompute, recompute};

/// Output holding the global gradient norm before clipping (after unscaling).
pub const GRAD_NORM: &str = "grad_norm";
/// Output, with loss scaling, that is `true` when the step's gradients were finite (and the
/// update applied).
pub const GRADS_FINITE: &str = "grads_finite";
/// State: AdamW's step count (f32, the number of updates applied so far).
pub const STEP_COUNT: &str = "optimizer:step";
/// State, with loss scaling: the loss scale divided by [`LossScaling::initial_scale`].
pub const LOSS_SCALE: &str = "loss_scale";
/// State, with loss scaling: finite steps since the scale last changed.
pub const GOOD_STEPS: &str = "loss_scale:good_steps";
/// Tag of the gradient-accumulation nodes of a micro-batch.
pub const ACCUMULATE_TAG: &str = "accumulate/";

/// SGD momentum buffer of weight `param`.
pub fn momentum_name(param: &str) -> String {
    format!("{param}:momentum")
}

/// AdamW first moment of weight `param`.
pub fn adam_m_name(param: &str) -> String {
    format!("{param}:adam_m")
}

/// AdamW second moment of weight `param`.
pub fn adam_v_name(param: &str) -> String {
    format!("{param}:adam_v")
}

/// Metadata of a step node in `phase` outside every micro-batch and layer.
pub(crate) fn in_phase(phase: Phase) -> NodeMeta {
    NodeMeta {
        phase: Some(phase),
        ..NodeMeta::default()
    }
}

/// The scope tag of micro-batch `k`.
pub fn micro_batch_tag(k: usize) -> String {
    format!("mb{k}/")
}

/// The optimizer and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    /// SGD with momentum and decoupled weight decay.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum coefficient.
        momentum: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
    /// AdamW with bias correction.
    AdamW {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator epsilon.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
}

impl Optimizer {
    /// The default AdamW learning rate: the tiny zoo models reach their loss thresholds
    /// within 200 steps with it.
    pub const DEFAULT_ADAMW_LR: f64 = 3e-3;
    /// The default SGD learning rate.
    pub const DEFAULT_SGD_LR: f64 = 0.1;

    /// AdamW with `lr`, betas (0.9, 0.95), eps 1e-8 and weight decay 0.01.
    pub fn adamw(lr: f64) -> Self {
        Optimizer::AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    /// SGD with `lr`, momentum 0.9 and no weight decay.
    pub fn sgd(lr: f64) -> Self {
        Optimizer::Sgd {
            lr,
            momentum: 0.9,
            weight_decay: 0.0,
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match *self {
            Optimizer::Sgd { lr, .. } | Optimizer::AdamW { lr, .. } => lr,
        }
    }
}

impl Default for Optimizer {
    fn default() -> Self {
        Optimizer::adamw(Optimizer::DEFAULT_ADAMW_LR)
    }
}

/// How the learning rate changes over training. The rate of update `t` (1-based: the count
/// of updates applied so far, this one included; a step skipped for non-finite gradients does
/// not count) is the optimizer's `lr` times
/// - during warmup (`t <= warmup`): `t / warmup`, a linear ramp from `lr / warmup`, as
///   Megatron-LM's `--lr-warmup-iters`;
/// - then, with `p = (t - warmup) / (decay_steps - warmup)` clamped to `[0, 1]`:
///   1 for [`LrDecay::Constant`], `m + (1 - m)(1 + cos(pi p)) / 2` for [`LrDecay::Cosine`]
///   and `m + (1 - m)(1 - p)` for [`LrDecay::Linear`], where `m` is `min_ratio`.
///
/// The factor is computed in the step graph from the optimizer's step count, so a resumed run
/// continues the schedule where it stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LrSchedule {
    /// Updates of linear warmup (0: none).
    pub warmup: u64,
    /// The decay after the warmup.
    pub decay: LrDecay,
}

/// The decay of an [`LrSchedule`] after its warmup.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum LrDecay {
    /// The rate stays at `lr`.
    #[default]
    Constant,
    /// Half a cosine from `lr` at the end of the warmup down to `min_ratio * lr` at update
    /// `steps`, then flat (GPT-3's and LLaMA's schedule, which decay to 10%).
    Cosine {
        /// The update at which the decay ends, counted from the start (warmup included).
        steps: u64,
        /// The final rate as a fraction of `lr`.
        min_ratio: f64,
    },
    /// A straight line from `lr` down to `min_ratio * lr` at update `steps`, then flat.
    Linear {
        /// The update at which the decay ends, counted from the start (warmup included).
        steps: u64,
        /// The final rate as a fraction of `lr`.
        min_ratio: f64,
    },
}

impl LrSchedule {
    /// Whether the rate never changes.
    pub fn is_constant(&self) -> bool {
        self.warmup == 0 && self.decay == LrDecay::Constant
    }

    /// The factor of update `t` (1-based), computed on the host: what the step graph
    /// computes in f32.
    pub fn factor(&self, t: u64) -> f64 {
        let t = t as f64;
        let w = self.warmup as f64;
        if self.warmup > 0 && t <= w {
            return t / w;
        }
        let ramp = |steps: u64| ((t - w) / (steps as f64 - w)).clamp(0.0, 1.0);
        match self.decay {
            LrDecay::Constant => 1.0,
            LrDecay::Cosine { steps, min_ratio } => {
                let p = ramp(steps);
                min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
            LrDecay::Linear { steps, min_ratio } => {
                min_ratio + (1.0 - min_ratio) * (1.0 - ramp(steps))
            }
        }
    }

    /// Checks the schedule's numbers: a decay must end after the warmup, and its final ratio
    /// lie in `[0, 1]`.
    pub fn check(&self) -> Result<(), LrScheduleError> {
        match self.decay {
            LrDecay::Constant => Ok(()),
            LrDecay::Cosine { steps, min_ratio } | LrDecay::Linear { steps, min_ratio } => {
                if steps <= self.warmup {
                    return Err(LrScheduleError::DecayEndsInWarmup {
                        steps,
                        warmup: self.warmup,
                    });
                }
                if !(0.0..=1.0).contains(&min_ratio) {
                    return Err(LrScheduleError::FinalRatio { min_ratio });
                }
                Ok(())
            }
        }
    }
}

/// What is wrong with an [`LrSchedule`]'s numbers.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub enum LrScheduleError {
    /// The decay ends at or before the end of the warmup.
    #[error(
        "the learning-rate decay must end after the warmup: it ends at step {steps}, the \
         warmup lasts {warmup} steps"
    )]
    DecayEndsInWarmup {
        /// The step the decay ends at.
        steps: u64,
        /// The warmup's length in steps.
        warmup: u64,
    },
    /// The final rate is not between 0 and the peak rate.
    #[error("the final learning rate must be between 0 and the peak rate: ratio {min_ratio}")]
    FinalRatio {
        /// The final rate over the peak rate.
        min_ratio: f64,
    },
}

/// Dynamic loss scaling (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaling {
    /// The scale of the first step.
    pub initial_scale: f64,
    /// Finite steps in a row after which the scale grows.
    pub growth_interval: u32,
    /// Factor applied when the scale grows.
    pub growth_factor: f64,
    /// Factor applied after a step with non-finite gradients.
    pub backoff_factor: f64,
}

impl Default for LossScaling {
    /// `2^16`, doubled after 2000 good steps, halved on overflow (PyTorch's defaults).
    fn default() -> Self {
        LossScaling {
            initial_scale: 65536.0,
            growth_interval: 2000,
            growth_factor: 2.0,
            backoff_factor: 0.5,
        }
    }
}

/// How to build a training step.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Clip gradients to this global L2 norm; `None` does not clip.
    pub clip_norm: Option<f64>,
    /// The dtype the forward and backward compute in: f32, bf16 or f16.
    pub compute_dtype: DType,
    /// Dynamic loss scaling, if any.
    pub loss_scaling: Option<LossScaling>,
    /// Micro-batches per step (gradient accumulation); at least 1.
    pub micro_batches: usize,
    /// Activation recompute policy.
    pub recompute: Recompute,
    /// How the learning rate changes over the steps.
    pub lr_schedule: LrSchedule,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            optimizer: Optimizer::default(),
            clip_norm: Some(1.0),
            compute_dtype: DType::F32,
            loss_scaling: None,
            micro_batches: 1,
            recompute: Recompute::None,
            lr_schedule: LrSchedule::default(),
        }
    }
}

impl TrainOptions {
    /// The defaults with compute dtype `dtype`, and loss scaling when it is f16.
    pub fn for_dtype(dtype: DType) -> Self {
        TrainOptions {
            compute_dtype: dtype,
            loss_scaling: (dtype == DType::F16).then(LossScaling::default),
            ..TrainOptions::default()
        }
    }
}

/// A built training step: the graph and what its state is.
#[derive(Clone, Debug)]
pub struct TrainStep {
    /// The step graph (see the module docs).
    pub graph: Graph,
    /// Names of the master weights, in the forward's order.
    pub weights: Vec<String>,
    /// Names of the other state: optimizer buffers, step count, loss-scaling state.
    pub optimizer_state: Vec<String>,
    /// Micro-batches per step.
    pub micro_batches: usize,
}

/// Builds the training step of `forward` (see the module docs). `forward` must have a
/// one-element float output `loss`; its data inputs are taken to have the batch on dim 0.
pub fn build_train_step(forward: &Graph, options: &TrainOptions) -> Result<TrainStep, PassError> {
    check_options(options)?;
    let bad_graph = |detail: String| PassError::BadGraph {
        graph: forward.name().to_string(),
        detail,
    };
    let fwd_loss = forward
        .output("loss")
        .ok_or_else(|| bad_graph("it has no `loss` output".into()))?;
    let m = options.micro_batches;
    let compute = options.compute_dtype;

    let mut g = Graph::new(forward.name());
    g.set_mesh(forward.mesh().cloned());

    // The state and the global-batch inputs.
    let order = forward.topo_order()?;
    let mut masters: Vec<(String, ValueId, Option<String>, NodeMeta)> = Vec::new();
    let mut sources: HashMap<ValueId, ValueId> = HashMap::new();
    for &n in &order {
        let node = forward.node(n);
        let op = match &node.op {
            Op::Parameter { .. } => node.op.clone(),
            Op::Input { name, ty, role } => {
                let Some((&b, rest)) = ty.dims().split_first() else {
                    return Err(bad_graph(format!(
                        "input `{name}` ({ty}) has no batch dim to split into micro-batches"
                    )));
                };
                let mut dims = vec![b.checked_mul(m).ok_or_else(|| {
                    bad_graph(format!("input `{name}`: {m} micro-batches of {b} overflow"))
                })?];
                dims.extend_from_slice(rest);
                Op::Input {
                    name: name.clone(),
                    ty: TensorType::new(ty.dtype, dims),
                    role: *role,
                }
            }
            _ => continue,
        };
        let id = g.add_node(op, &[])?;
        g.set_scope(id, node.scope.clone());
        g.set_meta(id, forward.meta(n));
        let v = g.node(id).outputs[0];
        g.set_sharding(v, forward.value(node.outputs[0]).sharding.clone())?;
        sources.insert(node.outputs[0], v);
        if let Op::Parameter { name, ty, .. } = &node.op {
            if !ty.dtype.is_float() {
                return Err(bad_graph(format!(
                    "parameter `{name}` is not a float ({ty})"
                )));
            }
            masters.push((name.clone(), v, node.scope.clone(), forward.meta(n)));
        }
    }
    let state = optimizer::declare_state(&mut g, &masters, options)?;
    check_names(forward, &masters, &state)?;

    // The seed of every micro-batch's backward: 1/m, times the loss scale.
    let seed_scale = {
        let mut e = Emitter::new(
            &mut g,
            Some("optimizer/".into()),
            in_phase(Phase::Optimizer),
        );
        match (&state.loss_scale, options.loss_scaling) {
            (Some(ls), Some(cfg)) => {
                let init = e.scalar(DType::F32, cfg.initial_scale)?;
                Some(e.mul(init, ls.scale)?)
            }
            _ => None,
        }
    };

    let needed = needed_nodes(forward, fwd_loss);
    let master_values: Vec<ValueId> = masters.iter().map(|(_, v, _, _)| *v).collect();
    let mut grad_sums: Vec<Option<ValueId>> = vec![None; masters.len()];
    let mut losses = Vec::with_capacity(m);
    for k in 0..m {
        let tag = micro_batch_tag(k);
        let scoped = |s: Option<&str>| Some(format!("{tag}{}", s.unwrap_or("")));
        let mb = u32::try_from(k).ok();
        // Micro-batch `k`'s copy of a forward node: its layer and part, in `phase`.
        let batched = |meta: NodeMeta, phase: Phase| NodeMeta {
            phase: Some(phase),
            micro_batch: mb,
            layer: meta.layer,
            part: meta.part,
            role: None,
        };
        let mut map: HashMap<ValueId, ValueId> = HashMap::new();
        for &n in &order {
            if !needed.contains(&n) {
                continue;
            }
            let node = forward.node(n);
            let meta = batched(
                forward.meta(n),
                forward.meta(n).phase.unwrap_or(Phase::Forward),
            );
            let mut e = Emitter::new(&mut g, scoped(node.scope.as_deref()), meta);
            if let Some(&global) = node.outputs.first().and_then(|v| sources.get(v)) {
                // A weight or an input of this micro-batch: slice, then cast to the compute dtype.
                let mut v = global;
                if matches!(node.op, Op::Input { .. }) && m > 1 {
                    // Rows `k, k + m, k + 2m, ...`: a split of the batch over data-parallel
                    // ranks (contiguous blocks) then splits every micro-batch the same way,
                    // so each rank's micro-batches are rows of its own shard.
                    let dims = e.dims(global);
                    let b = dims[0] / m;
                    let mut strided = vec![b, m];
                    strided.extend_from_slice(&dims[1..]);
                    let mut one = dims.clone();
                    one[0] = b;
                    v = e.reshape(v, &strided)?;
                    v = e.slice(v, 1, k, k + 1)?;
                    v = e.reshape(v, &one)?;
                }
                if e.ty(v).dtype.is_float() {
                    v = e.cast_if_needed(v, compute)?;
                }
                map.insert(node.outputs[0], v);
                continue;
            }
            let mut inputs: Vec<ValueId> = node.inputs.iter().map(|v| map[v]).collect();
            let op = match &node.op {
                Op::Constant { ty, value } if ty.dtype.is_float() => Op::Constant {
                    ty: ty.with_dtype(compute),
                    value: *value,
                },
                Op::Cast { to } if to.is_float() => Op::Cast { to: compute },
                Op::CrossEntropy => {
                    inputs[0] = e.cast_if_needed(inputs[0], DType::F32)?;
                    Op::CrossEntropy
                }
                op => op.clone(),
            };
            let outs = e.node(op, &inputs)?;
            for (&old, &new) in node.outputs.iter().zip(&outs) {
                e.g.set_sharding(new, forward.value(old).sharding.clone())?;
                map.insert(old, new);
            }
        }
        let loss_node = forward.value(fwd_loss).producer;
        let mut e = Emitter::new(
            &mut g,
            scoped(forward.node(loss_node).scope.as_deref()),
            batched(forward.meta(loss_node), Phase::Forward),
        );
        let loss = e.cast_if_needed(map[&fwd_loss], DType::F32)?;
        if e.ty(loss).num_elements() != 1 {
            return Err(bad_graph(format!(
                "the loss must have one element, not {}",
                e.ty(loss)
            )));
        }
        e.set_scope(Some(format!("{tag}{}", autodiff::GRAD_TAG)));
        e.set_meta(batched(NodeMeta::default(), Phase::Backward));
        let mut seed = e.full_like(loss, 1.0 / m as f64)?;
        if let Some(scale) = seed_scale {
            let scale = e.reshape(scale, &e.dims(loss))?;
            seed = e.mul(seed, scale)?;
        }
        losses.push(loss);

        let grads = autodiff::differentiate(&mut g, loss, Some(seed), &master_values)?;
        for (i, grad) in grads.into_iter().enumerate() {
            let Some(grad) = grad else { continue };
            let scope = crate::autodiff::with_tag(
                scoped(masters[i].2.as_deref()).as_deref(),
                ACCUMULATE_TAG,
            );
            let meta = batched(masters[i].3, Phase::Accumulate);
            let mut e = Emitter::new(&mut g, Some(scope), meta);
            grad_sums[i] = Some(match grad_sums[i] {
                Some(sum) => e.add(sum, grad)?,
                None => grad,
            });
        }
    }

    // The reported loss: the mean over micro-batches.
    let loss = {
        let mut e = Emitter::new(
            &mut g,
            Some(ACCUMULATE_TAG.to_string()),
            in_phase(Phase::Accumulate),
        );
        let mut total = losses[0];
        for &l in &losses[1..] {
            total = e.add(total, l)?;
        }
        if m > 1 {
            total = e.scale(total, 1.0 / m as f64)?;
        }
        e.reshape(total, &[])?
    };
    g.add_output("loss", loss)?;

    let params: Vec<optimizer::Weight> = masters
        .iter()
        .zip(&grad_sums)
        .map(|((name, value, scope, meta), grad)| optimizer::Weight {
            name: name.clone(),
            value: *value,
            grad: *grad,
            scope: scope.clone(),
            layer: meta.layer,
        })
        .collect();
    optimizer::emit_update(&mut g, &params, &state, options, seed_scale)?;

    let g = sequence(&g)?;
    let graph = recompute(&g, options.recompute)?;
    verify(&graph)?;
    Ok(TrainStep {
        graph,
        weights: masters.into_iter().map(|(name, _, _, _)| name).collect(),
        optimizer_state: state.names(),
        micro_batches: m,
    })
}

/// Forward nodes the loss depends on.
fn needed_nodes(forward: &Graph, loss: ValueId) -> HashSet<autopar_ir::NodeId> {
    let mut needed = HashSet::new();
    let mut stack = vec![forward.value(loss).producer];
    while let Some(n) = stack.pop() {
        if needed.insert(n) {
            stack.extend(
                forward
                    .node(n)
                    .inputs
                    .iter()
                    .map(|&v| forward.value(v).producer),
            );
        }
    }
    needed
}

fn check_options(o: &TrainOptions) -> Result<(), PassError> {
    let bad = |option, detail: String| Err(PassError::BadOption { option, detail });
    if o.micro_batches == 0 {
        return bad("--micro-batches", "must be at least 1".into());
    }
    if !o.compute_dtype.is_float() {
        return bad(
            "--dtype",
            format!("{} is not a float dtype", o.compute_dtype),
        );
    }
    let lr = o.optimizer.lr();
    if !(lr.is_finite() && lr > 0.0) {
        return bad("--lr", format!("{lr} must be a positive number"));
    }
    if let Some(c) = o.clip_norm
        && !(c.is_finite() && c > 0.0)
    {
        return bad("--clip-norm", format!("{c} must be a positive number"));
    }
    if let Some(ls) = o.loss_scaling {
        if !(ls.initial_scale.is_finite() && ls.initial_scale > 0.0) {
            return bad(
                "--loss-scale",
                format!("{} must be a positive number", ls.initial_scale),
            );
        }
        if ls.growth_interval == 0 {
            return bad(
                "--loss-scale",
                "the growth interval must be positive".into(),
            );
        }
    }
    Ok(())
}

/// The state names must not collide with the forward's parameters or with each other.
fn check_names(
    forward: &Graph,
    masters: &[(String, ValueId, Option<String>, NodeMeta)],
    state: &optimizer::State,
) -> Result<(), PassError> {
    let seen: HashSet<&str> = masters.iter().map(|(n, _, _, _)| n.as_str()).collect();
    let reserved = ["loss", GRAD_NORM, GRADS_FINITE];
    for name in state.names().iter().map(String::as_str).chain(reserved) {
        if seen.contains(name) {
            return Err(PassError::BadGraph {
                graph: forward.name().to_string(),
                detail: format!("parameter `{name}` clashes with a name of the training step"),
            });
        }
    }
    Ok(())
}
