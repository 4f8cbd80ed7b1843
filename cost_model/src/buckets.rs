//! Data-parallel gradient buckets as the compiler's `collectives` pass forms them, for the
//! step estimate: gradients taken in the order the backward produces them, a bucket closed
//! when the next gradient would overflow it or when it is full, a gradient larger than a
//! bucket in a bucket of its own, and a bucket size of 0 meaning one all-reduce per tensor.
//! Each bucket is one collective, with its own latency, ready when its last gradient is.

use crate::model::TransformerConfig;

/// A stretch of the backward that produces gradients: tensors of `tensor_bytes` (in the
/// order they are produced), finished one after another at even intervals from `start` to
/// `end` (seconds), the last at `end`.
#[derive(Clone, Debug, PartialEq)]
pub struct GradientSpan {
    /// When the stretch starts.
    pub start: f64,
    /// When its last gradient is ready.
    pub end: f64,
    /// Bytes of each gradient tensor, in production order.
    pub tensor_bytes: Vec<f64>,
}

/// One bucket: when its last gradient is ready, and its bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bucket {
    /// When it can start.
    pub ready: f64,
    /// Bytes it reduces.
    pub bytes: f64,
}

/// The buckets of `cap_bytes` (0: one per tensor) that the gradients of `spans`, in
/// production order, fill.
///
/// ```
/// # use autopar_cost_model::buckets::{gradient_buckets, GradientSpan};
/// // Two layers of 4 tensors of 10 bytes each; buckets of 25 bytes take two tensors.
/// let layer = |start: f64| GradientSpan {
///     start,
///     end: start + 4.0,
///     tensor_bytes: vec![10.0; 4],
/// };
/// let b = gradient_buckets(&[layer(0.0), layer(4.0)], 25.0);
/// assert_eq!(b.len(), 4);
/// assert_eq!((b[0].ready, b[0].bytes), (2.0, 20.0));
/// assert_eq!((b[3].ready, b[3].bytes), (8.0, 20.0));
/// // No bucketing: one all-reduce per tensor.
/// assert_eq!(gradient_buckets(&[layer(0.0), layer(4.0)], 0.0).len(), 8);
/// ```
pub fn gradient_buckets(spans: &[GradientSpan], cap_bytes: f64) -> Vec<Bucket> {
    let mut out = Vec::new();
    let mut open: Option<Bucket> = None;
    for span in spans {
        let n = span.tensor_bytes.len();
        for (k, &each) in span.tensor_bytes.iter().enumerate() {
            let ready = match k + 1 == n {
                true => span.end,
                false => span.start + (span.end - span.start) * (k + 1) as f64 / n as f64,
            };
            if let Some(b) = open
                && b.bytes + each > cap_bytes
            {
                out.push(b);
                open = None;
            }
            let b = open.get_or_insert(Bucket { ready, bytes: 0.0 });
            b.ready = ready;
            b.bytes += each;
            if b.bytes >= cap_bytes {
                out.extend(open.take());
            }
        }
    }
    out.extend(open);
    out
}

/// The parameters of each weight tensor of one layer that is not an expert's, in the order
/// the backward produces their gradients (the MLP's, or a MoE layer's shared expert and router, then the
/// second norm, the attention output projection, the QKV projection and the first norm),
/// with the sizes [`TransformerConfig::attention_params`] and
/// [`TransformerConfig::mlp_params`] count.
pub fn layer_gradient_params(cfg: &TransformerConfig) -> Vec<f64> {
    let (h, f) = (cfg.hidden as f64, cfg.ffn as f64);
    let d = cfg.head_dim() as f64;
    let (a, kv) = (cfg.heads as f64, cfg.kv_heads as f64);
    // A dense MLP of width `f`: output GEMM and bias, input GEMM(s) and bias(es).
    let dense = |f: f64| {
        let mut mlp = vec![f * h, h, h * f, f];
        if cfg.gated_mlp {
            mlp.extend([h * f, f]);
        }
        mlp
    };
    let mut out = if cfg.experts > 1 {
        // The routed experts reduce over their own groups; the shared expert (if any) and
        // the router are dense.
        let mut moe = match cfg.shared_ffn {
            0 => Vec::new(),
            s => dense(s as f64),
        };
        moe.push(h * cfg.experts as f64);
        moe
    } else {
        dense(f)
    };
    out.extend([
        h,
        h,
        a * d * h,
        h,
        h * (a + 2.0 * kv) * d,
        (a + 2.0 * kv) * d,
        h,
        h,
    ]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_gradient_gets_its_own_bucket_and_order_is_kept() {
        let spans = [
            GradientSpan {
                start: 0.0,
                end: 1.0,
                tensor_bytes: vec![5.0],
            },
            GradientSpan {
                start: 1.0,
                end: 2.0,
                tensor_bytes: vec![100.0],
            },
            GradientSpan {
                start: 2.0,
                end: 3.0,
                tensor_bytes: vec![5.0, 5.0],
            },
        ];
        let b = gradient_buckets(&spans, 20.0);
        let got: Vec<(f64, f64)> = b.iter().map(|b| (b.ready, b.bytes)).collect();
        assert_eq!(got, vec![(1.0, 5.0), (2.0, 100.0), (3.0, 10.0)]);
        // Every byte is reduced once, whatever the size.
        for cap in [0.0, 1.0, 7.5, 1e9] {
            let total: f64 = gradient_buckets(&spans, cap).iter().map(|b| b.bytes).sum();
            assert_eq!(total, 115.0);
        }
        assert_eq!(gradient_buckets(&spans, 1e9).len(), 1);
    }

    #[test]
    fn a_layers_tensors_add_up_to_its_parameters() {
        for cfg in [
            TransformerConfig::gpt("g", 2, 64, 4, 32, 256),
            TransformerConfig {
                gated_mlp: true,
                kv_heads: 2,
                ..TransformerConfig::gpt("l", 2, 64, 4, 32, 256)
            },
        ] {
            let sum: f64 = layer_gradient_params(&cfg).iter().sum();
            let want = cfg.attention_params() + cfg.mlp_params() + cfg.norm_params();
            assert_eq!(sum, want as f64, "{}", cfg.name);
        }
    }
}
