//! A training driver over step graphs: it holds the state between steps and runs one step
//! per call on the reference interpreter.
//!
//! A step graph (built by the compiler's training pass) keeps its whole state in `parameter`
//! nodes, and has an output of the same name for each state value it updates. [`Trainer`]
//! only relies on that convention: it initialises every parameter with
//! [`init_parameters`], feeds each step a [`synthetic_batch`] drawn for that step, and
//! replaces each state tensor by the output of the same name. Outputs that name no state
//! (the loss, diagnostics) are reported per step.

use autopar_ir::Graph;

use crate::TensorMap;
use crate::data::synthetic_batch;
use crate::error::RuntimeError;
use crate::init::init_parameters;
use crate::interp::{RunOptions, run};
use crate::tensor::Tensor;

/// What one training step reports.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// The 0-based index of the step (also the data step of its batch).
    pub step: u64,
    /// The `loss` output.
    pub loss: f64,
    /// The interpreter's peak bytes of live tensors during the step.
    pub peak_bytes: u64,
    /// The outputs that are not state (including `loss`).
    pub metrics: TensorMap,
}

impl StepReport {
    /// The value of a one-element metric.
    pub fn scalar(&self, name: &str) -> Result<f64, RuntimeError> {
        let t = self
            .metrics
            .get(name)
            .ok_or_else(|| RuntimeError::UnknownOutput { name: name.into() })?;
        t.scalar_value().ok_or_else(|| RuntimeError::NotScalar {
            name: name.into(),
            ty: t.ty().clone(),
        })
    }
}

/// Runs a step graph step after step (see the module docs).
#[derive(Clone, Debug)]
pub struct Trainer<'g> {
    graph: &'g Graph,
    state: TensorMap,
    seed: u64,
    next_step: u64,
    options: RunOptions,
}

impl<'g> Trainer<'g> {
    /// A trainer whose state is initialised from `seed`, which also seeds the data.
    pub fn new(graph: &'g Graph, seed: u64, options: RunOptions) -> Result<Self, RuntimeError> {
        let state = init_parameters(graph, seed)?;
        Ok(Trainer {
            graph,
            state,
            seed,
            next_step: 0,
            options,
        })
    }

    /// The current state, by parameter name.
    pub fn state(&self) -> &TensorMap {
        &self.state
    }

    /// Replaces one state tensor (it must exist and keep its type).
    pub fn set_state(&mut self, name: &str, value: Tensor) -> Result<(), RuntimeError> {
        let slot = self
            .state
            .get_mut(name)
            .ok_or_else(|| RuntimeError::Missing {
                feed: crate::Feed::Parameter,
                name: name.into(),
                expected: value.ty().clone(),
            })?;
        if slot.ty() != value.ty() {
            return Err(RuntimeError::WrongType {
                feed: crate::Feed::Parameter,
                name: name.into(),
                expected: slot.ty().clone(),
                actual: value.ty().clone(),
            });
        }
        *slot = value;
        Ok(())
    }

    /// Number of steps run so far.
    pub fn steps_done(&self) -> u64 {
        self.next_step
    }

    /// Runs one step on the next synthetic batch and updates the state.
    pub fn step(&mut self) -> Result<StepReport, RuntimeError> {
        let step = self.next_step;
        let batch = synthetic_batch(self.graph, self.seed, step)?;
        let out = run(self.graph, &self.state, &batch, self.options)?;
        let loss = out.scalar("loss")?;
        let mut metrics = TensorMap::new();
        for (name, t) in out.outputs {
            match self.state.get_mut(&name) {
                Some(slot) => *slot = t,
                None => {
                    metrics.insert(name, t);
                }
            }
        }
        self.next_step += 1;
        Ok(StepReport {
            step,
            loss,
            peak_bytes: out.peak_bytes,
            metrics,
        })
    }
}
