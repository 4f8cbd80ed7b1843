//! The optimizer part of the step graph: its state, loss unscaling, the global gradient
//! norm and clipping, the updates, and the loss-scale bookkeeping with skipped steps.

use autopar_ir::{
    BinaryOp, CompareOp, DType, Graph, Init, LayerId, NodeMeta, Op, Phase, TensorType, UnaryOp,
    ValueId,
};

use super::{
    GOOD_STEPS, GRAD_NORM, GRADS_FINITE, LOSS_SCALE, LrDecay, LrSchedule, Optimizer, STEP_COUNT,
    TrainOptions, adam_m_name, adam_v_name, in_phase, momentum_name,
};
use crate::autodiff::{Emitter, with_tag};
use crate::error::PassError;

/// Tag of the optimizer's nodes.
const OPTIMIZER_TAG: &str = "optimizer/";

/// A master weight and its accumulated gradient (`None` when the loss does not depend on it).
pub(super) struct Weight {
    pub name: String,
    pub value: ValueId,
    pub grad: Option<ValueId>,
    pub scope: Option<String>,
    /// The weight's layer, which its update nodes get.
    pub layer: Option<LayerId>,
}

/// Metadata of the optimizer's nodes for a weight in `layer`.
fn optimizer_meta(layer: Option<LayerId>) -> NodeMeta {
    NodeMeta {
        layer,
        ..in_phase(Phase::Optimizer)
    }
}

/// The loss-scaling state values.
pub(super) struct ScaleState {
    /// The scale relative to the initial one.
    pub scale: ValueId,
    /// Finite steps since the last change.
    pub good: ValueId,
}

/// The optimizer state values of a step graph.
pub(super) struct State {
    /// Per weight (in order), its buffers: `(name, value)`.
    pub buffers: Vec<Vec<(String, ValueId)>>,
    /// The count of applied updates (AdamW's, or a learning-rate schedule's).
    pub step: Option<ValueId>,
    /// Loss-scaling state.
    pub loss_scale: Option<ScaleState>,
}

impl State {
    /// Every state name, buffers first.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .buffers
            .iter()
            .flatten()
            .map(|(n, _)| n.clone())
            .collect();
        if self.step.is_some() {
            names.push(STEP_COUNT.into());
        }
        if self.loss_scale.is_some() {
            names.extend([LOSS_SCALE.to_string(), GOOD_STEPS.to_string()]);
        }
        names
    }
}

/// Declares the optimizer state as parameters, with the shardings of their weights.
pub(super) fn declare_state(
    g: &mut Graph,
    masters: &[(String, ValueId, Option<String>, NodeMeta)],
    options: &TrainOptions,
) -> Result<State, PassError> {
    let declare = |g: &mut Graph,
                   name: String,
                   ty: TensorType,
                   init,
                   scope: Option<&str>,
                   layer: Option<LayerId>| {
        // A parameter has no phase (it is state, read by every phase); the layer is its weight's.
        let meta = NodeMeta {
            layer,
            ..NodeMeta::default()
        };
        let mut e = Emitter::new(g, Some(with_tag(scope, OPTIMIZER_TAG)), meta);
        e.op(Op::Parameter { name, ty, init }, &[])
    };
    let mut buffers = Vec::with_capacity(masters.len());
    for (name, value, scope, meta) in masters {
        let ty = g.ty(*value).clone();
        let names = match options.optimizer {
            Optimizer::Sgd { .. } => vec![momentum_name(name)],
            Optimizer::AdamW { .. } => vec![adam_m_name(name), adam_v_name(name)],
        };
        let mut values = Vec::with_capacity(names.len());
        for n in names {
            let v = declare(
                g,
                n.clone(),
                ty.clone(),
                Init::Zeros,
                scope.as_deref(),
                meta.layer,
            )?;
            g.set_sharding(v, g.value(*value).sharding.clone())?;
            values.push((n, v));
        }
        buffers.push(values);
    }
    let scalar = TensorType::scalar(DType::F32);
    // AdamW's bias correction counts the updates; so does a learning-rate schedule.
    let counts_steps =
        matches!(options.optimizer, Optimizer::AdamW { .. }) || !options.lr_schedule.is_constant();
    let step = match counts_steps {
        true => Some(declare(
            g,
            STEP_COUNT.into(),
            scalar.clone(),
            Init::Zeros,
            None,
            None,
        )?),
        false => None,
    };
    let loss_scale = match options.loss_scaling {
        Some(_) => Some(ScaleState {
            scale: declare(g, LOSS_SCALE.into(), scalar.clone(), Init::Ones, None, None)?,
            good: declare(g, GOOD_STEPS.into(), scalar, Init::Zeros, None, None)?,
        }),
        None => None,
    };
    Ok(State {
        buffers,
        step,
        loss_scale,
    })
}

/// Emits unscaling, the gradient norm, clipping, the updates and the loss-scale update, and
/// adds the state outputs. `scale` is the absolute loss scale when loss scaling is on.
pub(super) fn emit_update(
    g: &mut Graph,
    weights: &[Weight],
    state: &State,
    options: &TrainOptions,
    scale: Option<ValueId>,
) -> Result<(), PassError> {
    let mut e = Emitter::new(g, Some(OPTIMIZER_TAG.into()), optimizer_meta(None));
    let inv_scale = scale.map(|s| e.unary(UnaryOp::Recip, s)).transpose()?;

    // Unscaled gradients and their global sum of squares.
    let mut grads = Vec::with_capacity(weights.len());
    let mut total: Option<ValueId> = None;
    for w in weights {
        e.set_scope(Some(with_tag(w.scope.as_deref(), OPTIMIZER_TAG)));
        e.set_meta(optimizer_meta(w.layer));
        let mut grad = match w.grad {
            Some(grad) => grad,
            None => e.full_like(w.value, 0.0)?,
        };
        if let Some(inv) = inv_scale {
            let dims = e.dims(grad);
            let inv = e.splat(inv, &dims)?;
            grad = e.mul(grad, inv)?;
        }
        let sq = e.unary(UnaryOp::Square, grad)?;
        let sq = e.sum_all(sq)?;
        total = Some(match total {
            Some(t) => e.add(t, sq)?,
            None => sq,
        });
        grads.push(grad);
    }
    e.set_scope(Some(OPTIMIZER_TAG.into()));
    e.set_meta(optimizer_meta(None));
    let total = match total {
        Some(t) => t,
        None => e.scalar(DType::F32, 0.0)?,
    };
    let norm = e.unary(UnaryOp::Sqrt, total)?;
    let mut outputs: Vec<(String, ValueId)> = vec![(GRAD_NORM.into(), norm)];
    // `x - x` is 0 for finite `x` and NaN for infinities and NaN.
    let finite = match state.loss_scale {
        Some(_) => {
            let diff = e.sub(total, total)?;
            let zero = e.full_like(total, 0.0)?;
            let finite = e.compare(CompareOp::Eq, diff, zero)?;
            outputs.push((GRADS_FINITE.into(), finite));
            Some(finite)
        }
        None => None,
    };
    let clip = match options.clip_norm {
        Some(max_norm) => {
            let eps = e.full_like(norm, 1e-6)?;
            let denom = e.add(norm, eps)?;
            let max_norm = e.full_like(norm, max_norm)?;
            let ratio = e.div(max_norm, denom)?;
            let one = e.full_like(norm, 1.0)?;
            Some(e.binary(BinaryOp::Min, one, ratio)?)
        }
        None => None,
    };
    let step = match state.step {
        Some(step) => {
            let one = e.full_like(step, 1.0)?;
            let next = e.add(step, one)?;
            let kept = keep_if(&mut e, finite, next, step)?;
            outputs.push((STEP_COUNT.into(), kept));
            Some(next)
        }
        None => None,
    };
    let lr_factor = match step {
        Some(t) if !options.lr_schedule.is_constant() => {
            Some(schedule_factor(&mut e, &options.lr_schedule, t)?)
        }
        _ => None,
    };

    for ((w, grad), buffers) in weights.iter().zip(grads).zip(&state.buffers) {
        e.set_scope(Some(with_tag(w.scope.as_deref(), OPTIMIZER_TAG)));
        e.set_meta(optimizer_meta(w.layer));
        let dims = e.dims(grad);
        let grad = match clip {
            Some(factor) => {
                let factor = e.splat(factor, &dims)?;
                e.mul(grad, factor)?
            }
            None => grad,
        };
        let (op, mut operands) = match options.optimizer {
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            } => (
                Op::SgdUpdate {
                    lr,
                    momentum,
                    weight_decay,
                },
                vec![w.value, grad],
            ),
            Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => (
                Op::AdamWUpdate {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                },
                vec![w.value, grad],
            ),
        };
        operands.extend(buffers.iter().map(|(_, v)| *v));
        if let Optimizer::AdamW { .. } = options.optimizer {
            operands.extend(step);
        }
        operands.extend(lr_factor);
        let results = e.node(op, &operands)?;
        let old = std::iter::once(w.value).chain(buffers.iter().map(|(_, v)| *v));
        let names = std::iter::once(w.name.clone()).chain(buffers.iter().map(|(n, _)| n.clone()));
        for ((name, old), new) in names.zip(old).zip(results) {
            let kept = match finite {
                Some(finite) => {
                    let finite = e.splat(finite, &dims)?;
                    e.select(finite, new, old)?
                }
                None => new,
            };
            e.g.set_sharding(kept, e.g.value(old).sharding.clone())?;
            outputs.push((name, kept));
        }
    }

    if let (Some(ls), Some(cfg)) = (&state.loss_scale, options.loss_scaling) {
        e.set_scope(Some(OPTIMIZER_TAG.into()));
        e.set_meta(optimizer_meta(None));
        let one = e.full_like(ls.good, 1.0)?;
        let good = e.add(ls.good, one)?;
        let interval = e.full_like(good, f64::from(cfg.growth_interval))?;
        let grow = e.compare(CompareOp::Ge, good, interval)?;
        let grown = e.scale(ls.scale, cfg.growth_factor)?;
        let scale_if_finite = e.select(grow, grown, ls.scale)?;
        let zero = e.full_like(good, 0.0)?;
        let good_if_finite = e.select(grow, zero, good)?;
        let backed_off = e.scale(ls.scale, cfg.backoff_factor)?;
        let scale = keep_if(&mut e, finite, scale_if_finite, backed_off)?;
        let good = keep_if(&mut e, finite, good_if_finite, zero)?;
        outputs.push((LOSS_SCALE.into(), scale));
        outputs.push((GOOD_STEPS.into(), good));
    }
    for (name, v) in outputs {
        e.g.add_output(name, v)?;
    }
    Ok(())
}

/// The learning-rate factor of update `t` (an `f32[]`, 1-based) under `schedule`, as
/// [`LrSchedule::factor`] defines it.
fn schedule_factor(
    e: &mut Emitter<'_>,
    schedule: &LrSchedule,
    t: ValueId,
) -> Result<ValueId, PassError> {
    let w = schedule.warmup as f64;
    let decayed = match schedule.decay {
        LrDecay::Constant => e.full_like(t, 1.0)?,
        LrDecay::Cosine { steps, min_ratio } | LrDecay::Linear { steps, min_ratio } => {
            // p = clamp((t - w) / (steps - w), 0, 1)
            let start = e.full_like(t, w)?;
            let since = e.sub(t, start)?;
            let p = e.scale(since, 1.0 / (steps as f64 - w))?;
            let zero = e.full_like(t, 0.0)?;
            let one = e.full_like(t, 1.0)?;
            let p = e.binary(BinaryOp::Max, p, zero)?;
            let p = e.binary(BinaryOp::Min, p, one)?;
            // shape in [0, 1]: (1 + cos(pi p)) / 2, or 1 - p.
            let shape = match schedule.decay {
                LrDecay::Cosine { .. } => {
                    let angle = e.scale(p, std::f64::consts::PI)?;
                    let cos = e.unary(UnaryOp::Cos, angle)?;
                    let one = e.full_like(t, 1.0)?;
                    let sum = e.add(one, cos)?;
                    e.scale(sum, 0.5)?
                }
                _ => {
                    let one = e.full_like(t, 1.0)?;
                    e.sub(one, p)?
                }
            };
            let span = e.scale(shape, 1.0 - min_ratio)?;
            let floor = e.full_like(t, min_ratio)?;
            e.add(floor, span)?
        }
    };
    if schedule.warmup == 0 {
        return Ok(decayed);
    }
    let ramp = e.scale(t, 1.0 / w)?;
    let end = e.full_like(t, w)?;
    let warming = e.compare(CompareOp::Le, t, end)?;
    e.select(warming, ramp, decayed)
}

/// `if finite { a } else { b }` for rank-0 values; `a` when there is no finiteness check.
fn keep_if(
    e: &mut Emitter<'_>,
    finite: Option<ValueId>,
    a: ValueId,
    b: ValueId,
) -> Result<ValueId, PassError> {
    match finite {
        Some(f) => e.select(f, a, b),
        None => Ok(a),
    }
}
