//! The parts every language model of the zoo shares: its token inputs, and the loss of its
//! logits against the next tokens.

use autopar_ir::{DType, InputRole, LayerId};

use crate::builder::ModelBuilder;
use crate::tensor::Tensor;

/// The `tokens` and `targets` (next tokens) inputs, both `i32[batch, seq]`.
pub(crate) fn token_inputs(
    m: &ModelBuilder,
    batch: usize,
    seq: usize,
    vocab: usize,
) -> (Tensor<'_>, Tensor<'_>) {
    let tokens = m.input(
        "tokens",
        DType::I32,
        [batch, seq],
        InputRole::Tokens { vocab },
    );
    let targets = m.input(
        "targets",
        DType::I32,
        [batch, seq],
        InputRole::NextTokens { vocab },
    );
    (tokens, targets)
}

/// Logits of the final hidden states `x[b, s, h]` against the output embedding `[v, h]`
/// (layer [`LayerId::Head`], scope `head`), and their mean cross-entropy against `targets`
/// (layer [`LayerId::Loss`], scope `loss`).
pub(crate) fn next_token_loss<'m>(
    m: &'m ModelBuilder,
    x: Tensor<'m>,
    output_embedding: Tensor<'m>,
    targets: Tensor<'m>,
) -> Tensor<'m> {
    let logits = m.layer(LayerId::Head, "head", || {
        x.einsum("bsh,vh->bsv", output_embedding)
    });
    m.layer(LayerId::Loss, "loss", || {
        logits.cross_entropy(targets).mean([0, 1])
    })
}
