//! A two-layer MLP regressor with a mean-squared-error loss: the smallest model that trains,
//! used where a transformer would only add noise (first tests of a pass or a backend).

use autopar_ir::{DType, InputRole, LayerId, WeightRole, axis};

use crate::builder::{ModelBuilder, ZEROS, normal};
use crate::tensor::Tensor;

/// Sizes of the MLP. Spec keys are given in parentheses.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpConfig {
    /// Input features (`in`).
    pub n_in: usize,
    /// Hidden width (`hidden`).
    pub hidden: usize,
    /// Regression outputs (`out`).
    pub n_out: usize,
}

impl MlpConfig {
    /// Number of trainable parameters, counted from the sizes.
    pub(crate) fn num_parameters(&self) -> u128 {
        let (i, h, o) = (self.n_in as u128, self.hidden as u128, self.n_out as u128);
        i * h + h + h * o + o
    }
}

/// Builds the model for `batch` samples and returns the scalar loss.
pub(crate) fn build<'m>(m: &'m ModelBuilder, c: &MlpConfig, batch: usize) -> Tensor<'m> {
    let (b, i, h, o) = (batch, c.n_in, c.hidden, c.n_out);
    let features = m.input("features", DType::F32, [b, i], InputRole::Features);
    let targets = m.input("targets", DType::F32, [b, o], InputRole::RegressionTargets);

    // Its layer sequence is an input layer, an output layer and the loss: no repeated blocks.
    // LeCun-normal init (std 1/sqrt(fan_in)) so that the tiny model trains from scratch.
    let hidden = m.layer(LayerId::Embedding, "fc1", || {
        let w = m
            .param("w", [i, h], normal(fan_in_std(i)))
            .role(WeightRole::Dense)
            .shard(1, axis::TP);
        let bias = m
            .param("b", [h], ZEROS)
            .role(WeightRole::Dense)
            .shard(0, axis::TP);
        features.einsum("bi,ih->bh", w).add_bias(bias).gelu()
    });
    let prediction = m.layer(LayerId::Head, "fc2", || {
        let w = m
            .param("w", [h, o], normal(fan_in_std(h)))
            .role(WeightRole::Dense)
            .shard(0, axis::TP);
        let bias = m.param("b", [o], ZEROS).role(WeightRole::Dense);
        hidden.einsum("bh,ho->bo", w).add_bias(bias)
    });
    m.layer(LayerId::Loss, "loss", || {
        (prediction - targets).square().mean([0, 1])
    })
}

fn fan_in_std(fan_in: usize) -> f64 {
    1.0 / (fan_in as f64).sqrt()
}
