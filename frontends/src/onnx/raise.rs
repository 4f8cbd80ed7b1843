//! Raising: the patterns exporters decompose autopar's ops into, found on the typed ONNX
//! graph, and the model structure (layers, parts, weight roles) read off what was found.
//!
//! A pattern is matched from its root node backwards through the producers of computed
//! values; constants (scales, epsilons, masks, rotary tables) are matched by their values.
//! A match replaces only its root: the nodes inside are emitted too if anything else reads
//! them, so a wrong guess about sharing can cost time but never change results.

use std::collections::{BTreeMap, HashMap};

use autopar_ir::{DType, InputRole, LayerId, Part, TensorType, WeightRole};

use super::import::{Importer, NodeRec, Val};

/// A value in the layout attention takes (`[b, s, heads, d]`), built from ONNX values.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// An ONNX value that already has the layout.
    Value(String),
    /// A permutation of another.
    Transpose(Box<Expr>, Vec<usize>),
    /// The rotary embedding of another, at positions `0..s`.
    Rotary(Box<Expr>, f64),
}

impl Expr {
    fn leaves(&self, out: &mut Vec<String>) {
        match self {
            Expr::Value(v) => out.push(v.clone()),
            Expr::Transpose(e, _) | Expr::Rotary(e, _) => e.leaves(out),
        }
    }
}

/// A pattern found at a root node, and what replaces it.
#[derive(Clone, Debug, PartialEq)]
pub enum Raised {
    /// `gamma * x / sqrt(mean(x^2) + eps)`.
    RmsNorm {
        /// The normalised value.
        x: String,
        /// The scale (an initializer).
        gamma: String,
        /// The epsilon.
        eps: f64,
    },
    /// `gamma * (x - mean(x)) / sqrt(var(x) + eps) + beta`, decomposed (opsets before 17
    /// have no `LayerNormalization`).
    LayerNorm {
        /// The normalised value.
        x: String,
        /// The scale.
        gamma: String,
        /// The shift.
        beta: String,
        /// The epsilon.
        eps: f64,
    },
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    Gelu {
        /// The argument.
        x: String,
    },
    /// `0.5 x (1 + erf(x / sqrt 2))`.
    GeluErf {
        /// The argument.
        x: String,
    },
    /// `x * sigmoid(x)`.
    Silu {
        /// The argument.
        x: String,
    },
    /// `reshape(x W + b, [b, s, n, d])`: the head-shaped einsum with `W` as `[h, n, d]`.
    Projection {
        /// The input `[b, s, h]`.
        x: String,
        /// The weight.
        w: String,
        /// The bias.
        b: Option<String>,
    },
    /// `reshape(o, [b, s, n*d]) W`: the einsum with `W` as `[n, d, h]`.
    OutProjection {
        /// Attention's output `[b, s, n, d]`.
        x: String,
        /// The weight.
        w: String,
        /// Always `None`: the bias is added by the node after.
        b: Option<String>,
    },
    /// The output layer `x W`, with `W` as `[v, h]` (the token embedding when tied).
    Head {
        /// The final hidden states.
        x: String,
        /// The weight.
        w: String,
    },
    /// Scaled dot-product attention.
    Attention {
        /// Queries.
        q: Expr,
        /// Keys.
        k: Expr,
        /// Values.
        v: Expr,
        /// Future keys masked.
        causal: bool,
        /// The logit scale.
        scale: f64,
    },
}

impl Raised {
    /// The name of the autopar op it becomes.
    pub fn op_name(&self) -> &'static str {
        match self {
            Raised::RmsNorm { .. } => "rms_norm",
            Raised::LayerNorm { .. } => "layer_norm",
            Raised::Gelu { .. } => "gelu",
            Raised::GeluErf { .. } => "gelu_erf",
            Raised::Silu { .. } => "silu",
            Raised::Projection { .. } => "qkv_projection",
            Raised::OutProjection { .. } => "out_projection",
            Raised::Head { .. } => "head",
            Raised::Attention { .. } => "attention",
        }
    }

    /// The ONNX values it reads.
    pub fn leaves(&self) -> Vec<String> {
        match self {
            Raised::RmsNorm { x, gamma, .. } => vec![x.clone(), gamma.clone()],
            Raised::LayerNorm { x, gamma, beta, .. } => {
                vec![x.clone(), gamma.clone(), beta.clone()]
            }
            Raised::Gelu { x } | Raised::GeluErf { x } | Raised::Silu { x } => vec![x.clone()],
            Raised::Projection { x, w, b } | Raised::OutProjection { x, w, b } => {
                let mut v = vec![x.clone(), w.clone()];
                v.extend(b.clone());
                v
            }
            Raised::Head { x, w } => vec![x.clone(), w.clone()],
            Raised::Attention { q, k, v, .. } => {
                let mut out = Vec::new();
                q.leaves(&mut out);
                k.leaves(&mut out);
                v.leaves(&mut out);
                out
            }
        }
    }
}

/// The structure of the imported model: where each node belongs, and what each weight is.
#[derive(Clone, Debug, Default)]
pub struct Structure {
    /// Transformer blocks found.
    pub blocks: usize,
    /// `(first node, layer)`, in node order: node `i` belongs to the last entry at or before it.
    layers: Vec<(usize, Option<LayerId>)>,
    /// The part of each node that has one.
    parts: HashMap<usize, Part>,
    /// Weight roles by initializer name.
    pub roles: HashMap<String, WeightRole>,
    /// Roles of the graph inputs.
    pub input_roles: HashMap<String, InputRole>,
    /// The dtype of the token input, for the targets of a cross-entropy loss.
    pub token_dtype: Option<DType>,
    /// What was not understood.
    pub not_understood: Vec<String>,
    /// Native ONNX ops that are autopar ops already (`layer_norm`), counted.
    pub native: BTreeMap<String, usize>,
}

impl Structure {
    /// The layer and part of node `i`.
    pub fn position(&self, i: usize) -> (Option<LayerId>, Option<Part>) {
        let layer = self
            .layers
            .iter()
            .rev()
            .find(|(start, _)| *start <= i)
            .and_then(|(_, l)| *l);
        (layer, self.parts.get(&i).copied())
    }
}

impl Importer {
    fn dims_of(&self, v: &str) -> Option<Vec<usize>> {
        self.vals.get(v).map(Val::dims)
    }

    fn scalar(&self, v: &str) -> Option<f64> {
        self.vals.get(v)?.known()?.scalar()
    }

    fn is_param(&self, v: &str) -> bool {
        matches!(self.vals.get(v), Some(Val::Known { init: Some(_), t }) if t.dtype.is_float())
    }

    /// The node producing `v`, if it is computed and made by `op`.
    fn made_by(&self, v: &str, op: &str) -> Option<(usize, &NodeRec)> {
        self.producing(v).filter(|(_, n)| n.op == op)
    }

    /// The two inputs of a binary node, in both orders.
    fn pairs(n: &NodeRec) -> [(String, String); 2] {
        let a = n.inputs.first().cloned().unwrap_or_default();
        let b = n.inputs.get(1).cloned().unwrap_or_default();
        [(a.clone(), b.clone()), (b, a)]
    }

    /// The factors of a product of `Mul` nodes (at most 8, or `None`).
    fn factors(&self, v: &str, out: &mut Vec<String>, depth: usize) -> Option<()> {
        if out.len() > 8 || depth > 8 {
            return None;
        }
        match self.made_by(v, "Mul") {
            Some((_, n)) if n.inputs.len() == 2 => {
                self.factors(&n.inputs[0].clone(), out, depth + 1)?;
                self.factors(&n.inputs[1].clone(), out, depth + 1)
            }
            _ => {
                out.push(v.to_string());
                Some(())
            }
        }
    }

    /// The known scalar factors of a product multiplied together, and the others.
    fn product(&self, v: &str) -> Option<(f64, Vec<String>)> {
        let mut fs = Vec::new();
        self.factors(v, &mut fs, 0)?;
        let mut c = 1.0;
        let mut rest = Vec::new();
        for f in fs {
            match self.scalar(&f) {
                Some(s) => c *= s,
                None => rest.push(f),
            }
        }
        Some((c, rest))
    }

    fn reduce_mean_last(&self, v: &str) -> Option<String> {
        let (_, n) = self.made_by(v, "ReduceMean")?;
        let x = n.inputs.first()?.clone();
        let rank = self.dims_of(&x)?.len() as i64;
        let axes = match (self.opset >= 18, n.input(1)) {
            (true, Some(a)) => self.vals.get(a)?.known()?.as_i64s(),
            (true, None) => return None,
            (false, _) => n.ints("axes")?,
        };
        let last = axes.len() == 1 && (axes[0] == -1 || axes[0] == rank - 1);
        (last && n.int("keepdims", 1) != 0).then_some(x)
    }

    /// `x` when `v` is `x^2` (`Pow(x, 2)` or `x * x`).
    fn square_of(&self, v: &str) -> Option<String> {
        if let Some((_, n)) = self.made_by(v, "Pow") {
            return (self.scalar(n.input(1)?) == Some(2.0)).then(|| n.inputs[0].clone());
        }
        let (_, n) = self.made_by(v, "Mul")?;
        (n.inputs.len() == 2 && n.inputs[0] == n.inputs[1]).then(|| n.inputs[0].clone())
    }

    /// `(x, eps)` when `v` is `sqrt(mean(x^2) + eps)`.
    fn rms_of(&self, v: &str) -> Option<(String, f64)> {
        let (_, sqrt) = self.made_by(v, "Sqrt")?;
        let (_, add) = self.made_by(sqrt.input(0)?, "Add")?;
        Self::pairs(add).into_iter().find_map(|(a, b)| {
            let eps = self.scalar(&b)?;
            let x = self.square_of(&self.reduce_mean_last(&a)?)?;
            Some((x, eps))
        })
    }

    /// `(x, eps)` when `v` is `x / sqrt(mean(x^2) + eps)` in one of its spellings.
    fn normalized(&self, v: &str) -> Option<(String, f64)> {
        if let Some((_, div)) = self.made_by(v, "Div") {
            let (x, eps) = self.rms_of(div.input(1)?)?;
            return (div.input(0)? == x).then_some((x, eps));
        }
        let (_, mul) = self.made_by(v, "Mul")?;
        Self::pairs(mul).into_iter().find_map(|(x, r)| {
            let denom = if let Some((_, rec)) = self.made_by(&r, "Reciprocal") {
                rec.input(0)?.to_string()
            } else {
                let (_, div) = self.made_by(&r, "Div")?;
                (self.scalar(div.input(0)?) == Some(1.0)).then(|| div.inputs[1].clone())?
            };
            let (x2, eps) = self.rms_of(&denom)?;
            (x2 == x).then_some((x, eps))
        })
    }

    fn try_rms(&self, n: &NodeRec) -> Option<Raised> {
        if n.op != "Mul" {
            return None;
        }
        Self::pairs(n).into_iter().find_map(|(g, y)| {
            if !self.is_param(&g) || self.dims_of(&g)?.len() != 1 {
                return None;
            }
            let (x, eps) = self.normalized(&y)?;
            (self.dims_of(&x)?.last() == self.dims_of(&g)?.last()).then_some(Raised::RmsNorm {
                x,
                gamma: g,
                eps,
            })
        })
    }

    /// `x` when `v` is `x - mean(x)` over the last dim.
    fn centered(&self, v: &str) -> Option<String> {
        let (_, sub) = self.made_by(v, "Sub")?;
        let x = sub.input(0)?.to_string();
        (self.reduce_mean_last(sub.input(1)?)? == x).then_some(x)
    }

    fn try_layer_norm(&self, n: &NodeRec) -> Option<Raised> {
        if n.op != "Add" {
            return None;
        }
        let one_d = |v: &str| self.is_param(v) && self.dims_of(v).is_some_and(|d| d.len() == 1);
        Self::pairs(n).into_iter().find_map(|(y, beta)| {
            if !one_d(&beta) {
                return None;
            }
            let (_, mul) = self.made_by(&y, "Mul")?;
            Self::pairs(mul).into_iter().find_map(|(z, gamma)| {
                if !one_d(&gamma) {
                    return None;
                }
                let (_, div) = self.made_by(&z, "Div")?;
                let d = div.input(0)?;
                let x = self.centered(d)?;
                // The variance is the mean square of the same centred value.
                let (_, sqrt) = self.made_by(div.input(1)?, "Sqrt")?;
                let (_, add) = self.made_by(sqrt.input(0)?, "Add")?;
                let eps = Self::pairs(add).into_iter().find_map(|(a, b)| {
                    let eps = self.scalar(&b)?;
                    (self.square_of(&self.reduce_mean_last(&a)?)? == d).then_some(eps)
                })?;
                Some(Raised::LayerNorm {
                    x,
                    gamma,
                    beta: beta.clone(),
                    eps,
                })
            })
        })
    }

    fn try_gelu(&self, n: &NodeRec) -> Option<Raised> {
        if n.op != "Mul" {
            return None;
        }
        let (c, rest) = self.product(n.outputs.first()?)?;
        if (c - 0.5).abs() > 1e-6 || rest.len() != 2 {
            return None;
        }
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs();
        [(&rest[0], &rest[1]), (&rest[1], &rest[0])]
            .into_iter()
            .find_map(|(x, a)| {
                let (_, add) = self.made_by(a, "Add")?;
                Self::pairs(add).into_iter().find_map(|(one, t)| {
                    (self.scalar(&one)? == 1.0).then_some(())?;
                    if let Some((_, erf)) = self.made_by(&t, "Erf") {
                        return self
                            .over_sqrt2(erf.input(0)?, x)
                            .then(|| Raised::GeluErf { x: x.clone() });
                    }
                    let (_, tanh) = self.made_by(&t, "Tanh")?;
                    let (c1, inner) = self.product(tanh.input(0)?)?;
                    if !close(c1, (2.0 / std::f64::consts::PI).sqrt()) || inner.len() != 1 {
                        return None;
                    }
                    let (_, sum) = self.made_by(&inner[0], "Add")?;
                    Self::pairs(sum).into_iter().find_map(|(x2, cube)| {
                        if &x2 != x {
                            return None;
                        }
                        let (c2, fs) = self.product(&cube)?;
                        let cubed = fs.iter().all(|f| f == x) && fs.len() == 3
                            || fs.len() == 1
                                && self.made_by(&fs[0], "Pow").is_some_and(|(_, p)| {
                                    p.input(0) == Some(x.as_str())
                                        && p.input(1).and_then(|e| self.scalar(e)) == Some(3.0)
                                });
                        (cubed && close(c2, 0.044715)).then(|| Raised::Gelu { x: x.clone() })
                    })
                })
            })
    }

    /// True when `v` is `x / sqrt 2` (a division, or a product with `1 / sqrt 2`).
    fn over_sqrt2(&self, v: &str, x: &str) -> bool {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs();
        if let Some((_, div)) = self.made_by(v, "Div") {
            return div.input(0) == Some(x)
                && div
                    .input(1)
                    .and_then(|d| self.scalar(d))
                    .is_some_and(|d| close(d, std::f64::consts::SQRT_2));
        }
        self.product(v).is_some_and(|(c, rest)| {
            rest.len() == 1 && rest[0] == x && close(c, std::f64::consts::FRAC_1_SQRT_2)
        })
    }

    fn try_silu(&self, n: &NodeRec) -> Option<Raised> {
        if n.op != "Mul" {
            return None;
        }
        Self::pairs(n).into_iter().find_map(|(x, s)| {
            let (_, sig) = self.made_by(&s, "Sigmoid")?;
            (sig.input(0)? == x).then(|| Raised::Silu { x: x.clone() })
        })
    }

    /// `(x, w, b)` when `v` is `x W + b` (or `x W`) with `W` a 2-D initializer.
    fn linear(&self, v: &str) -> Option<(String, String, Option<String>)> {
        self.linear_at(v, true)
    }

    fn linear_at(&self, v: &str, bias: bool) -> Option<(String, String, Option<String>)> {
        if let Some((_, add)) = self.made_by(v, "Add").filter(|_| bias) {
            return Self::pairs(add).into_iter().find_map(|(b, y)| {
                if !self.is_param(&b) || self.dims_of(&b)?.len() != 1 {
                    return None;
                }
                let (x, w, None) = self.linear_at(&y, false)? else {
                    return None;
                };
                Some((x, w, Some(b)))
            });
        }
        let (_, mm) = self.made_by(v, "MatMul")?;
        let (x, w) = (mm.input(0)?.to_string(), mm.input(1)?.to_string());
        (self.is_param(&w) && self.dims_of(&w)?.len() == 2).then_some((x, w, None))
    }

    fn try_projection(&mut self, n: &NodeRec) -> Option<Raised> {
        if n.op != "Reshape" {
            return None;
        }
        let out = self.dims_of(n.outputs.first()?)?;
        let (x, w, b) = self.linear(n.input(0)?)?;
        let (xd, wd) = (self.dims_of(&x)?, self.dims_of(&w)?);
        let [bb, s, nh, d] = out[..] else { return None };
        if xd != [bb, s, wd[0]] || nh * d != wd[1] {
            return None;
        }
        self.claim_shape(&w, vec![wd[0], nh, d])?;
        if let Some(b) = &b {
            self.claim_shape(b, vec![nh, d])?;
        }
        Some(Raised::Projection { x, w, b })
    }

    /// Declares initializer `name` in `dims` unless another pattern chose other dims.
    fn claim_shape(&mut self, name: &str, dims: Vec<usize>) -> Option<()> {
        match self.param_shapes.get(name) {
            Some(d) if *d != dims => None,
            _ => {
                self.param_shapes.insert(name.to_string(), dims);
                Some(())
            }
        }
    }

    fn try_out_projection(&mut self, n: &NodeRec, attention_outputs: &[String]) -> Option<Raised> {
        if n.op != "MatMul" {
            return None;
        }
        let w = n.input(1)?.to_string();
        let (_, reshape) = self.made_by(n.input(0)?, "Reshape")?;
        let x = reshape.input(0)?.to_string();
        if !self.is_param(&w) || !attention_outputs.contains(&x) {
            return None;
        }
        let (xd, wd) = (self.dims_of(&x)?, self.dims_of(&w)?);
        let [_, _, nh, d] = xd[..] else { return None };
        if wd.len() != 2 || wd[0] != nh * d {
            return None;
        }
        self.claim_shape(&w, vec![nh, d, wd[1]])?;
        Some(Raised::OutProjection { x, w, b: None })
    }

    /// `(x, base)` when `v` is the rotate-half rotary embedding of `x` (`[b, n, s, d]`).
    fn rotary_of(&self, v: &str) -> Option<(String, f64)> {
        let (_, add) = self.made_by(v, "Add")?;
        Self::pairs(add).into_iter().find_map(|(a, b)| {
            let (_, ma) = self.made_by(&a, "Mul")?;
            let (_, mb) = self.made_by(&b, "Mul")?;
            Self::pairs(ma).into_iter().find_map(|(x, cos)| {
                Self::pairs(mb).into_iter().find_map(|(r, sin)| {
                    let rotated = self.rotate_half_of(&r)?;
                    if rotated != x {
                        return None;
                    }
                    let base = self.rotary_base(&cos, &sin, &self.dims_of(&x)?)?;
                    Some((x.clone(), base))
                })
            })
        })
    }

    /// `x` when `v` is `concat(-x[..., d/2:], x[..., :d/2])`.
    fn rotate_half_of(&self, v: &str) -> Option<String> {
        let (_, cat) = self.made_by(v, "Concat")?;
        let (neg, lo) = (cat.input(0)?, cat.input(1)?);
        let (_, neg) = self.made_by(neg, "Neg")?;
        let half = |s: &str, first: bool| -> Option<String> {
            let (_, sl) = self.made_by(s, "Slice")?;
            let x = sl.input(0)?.to_string();
            let d = *self.dims_of(&x)?.last()? as i64;
            let rank = self.dims_of(&x)?.len() as i64;
            let get = |k: usize| Some(self.vals.get(sl.input(k)?)?.known()?.as_i64s());
            let (st, en) = (get(1)?, get(2)?);
            let axes = get(3).unwrap_or_else(|| vec![rank - 1]);
            let ok_axis = axes.len() == 1 && (axes[0] == -1 || axes[0] == rank - 1);
            let (s0, e0) = (st.first()?.clamp(&0, &d).to_owned(), (*en.first()?).min(d));
            let ok = match first {
                true => s0 == 0 && e0 == d / 2,
                false => s0 == d / 2 && e0 == d,
            };
            (ok_axis && ok && cat.int("axis", 0).rem_euclid(rank) == rank - 1).then_some(x)
        };
        let x = half(neg.input(0)?, false)?;
        (half(lo, true)? == x).then_some(x)
    }

    /// The rotary base whose cos/sin tables `cos` and `sin` are, for `x` of `dims`.
    fn rotary_base(&self, cos: &str, sin: &str, dims: &[usize]) -> Option<f64> {
        let (c, s) = (self.vals.get(cos)?.known()?, self.vals.get(sin)?.known()?);
        let [.., seq, d] = dims[..] else { return None };
        let table_ok = |t: &super::tensor::HostTensor| {
            t.dims.len() >= 2
                && t.dims[t.dims.len() - 2..] == [seq, d]
                && t.dims[..t.dims.len() - 2].iter().all(|&k| k == 1)
        };
        if !table_ok(c) || !table_ok(s) || seq < 2 || d < 4 || d % 2 != 0 {
            return None;
        }
        let half = d / 2;
        let theta = s.data.f64(d + 1).atan2(c.data.f64(d + 1));
        let base = theta.powf(-(d as f64) / 2.0);
        if !base.is_finite() || base <= 1.0 {
            return None;
        }
        for p in 0..seq {
            for i in 0..d {
                let angle = p as f64 * base.powf(-2.0 * (i % half) as f64 / d as f64);
                let k = p * d + i;
                if (c.data.f64(k) - angle.cos()).abs() > 1e-4
                    || (s.data.f64(k) - angle.sin()).abs() > 1e-4
                {
                    return None;
                }
            }
        }
        // Bases are round numbers (10000, 500000): snap to the nearest integer when it fits.
        let round = base.round();
        Some(if (round - base).abs() <= 1e-3 * base {
            round
        } else {
            base
        })
    }

    /// `v` (`[b, n, s, d]`) as an expression in the `[b, s, n, d]` layout.
    fn bsnd(&self, v: &str) -> Expr {
        self.bsnd_at(v, true)
    }

    fn bsnd_at(&self, v: &str, rotary: bool) -> Expr {
        if let Some((x, base)) = self.rotary_of(v).filter(|_| rotary) {
            return Expr::Rotary(Box::new(self.bsnd_at(&x, false)), base);
        }
        if let Some((_, t)) = self.made_by(v, "Transpose")
            && t.ints("perm").as_deref() == Some(&[0, 2, 1, 3])
            && let Some(x) = t.input(0)
        {
            return Expr::Value(x.to_string());
        }
        Expr::Transpose(Box::new(Expr::Value(v.to_string())), vec![0, 2, 1, 3])
    }

    /// The key/value heads behind a grouped-query repeat (`reshape(expand(unsqueeze(x, 2)))`).
    fn unrepeated(&self, v: &str) -> String {
        let found = (|| {
            let (_, r) = self.made_by(v, "Reshape")?;
            let (_, e) = self.made_by(r.input(0)?, "Expand")?;
            let (_, u) = self.made_by(e.input(0)?, "Unsqueeze")?;
            let axes = match u.input(1) {
                Some(a) => self.vals.get(a)?.known()?.as_i64s(),
                None => u.ints("axes")?,
            };
            let x = u.input(0)?.to_string();
            let (xd, ed, out) = (
                self.dims_of(&x)?,
                self.dims_of(e.outputs.first()?)?,
                self.dims_of(v)?,
            );
            let [b, kv, s, d] = xd[..] else { return None };
            let ok = axes == [2]
                && ed.len() == 5
                && ed[..2] == [b, kv]
                && ed[3..] == [s, d]
                && out == [b, kv * ed[2], s, d];
            ok.then_some(x)
        })();
        found.unwrap_or_else(|| v.to_string())
    }

    fn try_attention(&self, n: &NodeRec) -> Option<Raised> {
        if n.op != "Transpose" || n.ints("perm").as_deref() != Some(&[0, 2, 1, 3]) {
            return None;
        }
        let (_, pv) = self.made_by(n.input(0)?, "MatMul")?;
        let (_, softmax) = self.made_by(pv.input(0)?, "Softmax")?;
        let z = softmax.input(0)?;
        if !matches!(softmax.int("axis", -1), -1 | 3) || self.dims_of(z)?.len() != 4 {
            return None;
        }
        let (y, causal) = self.unmasked(z)?;
        let (s, scale) = self.unscaled(&y);
        let (_, qk) = self.made_by(&s, "MatMul")?;
        let q = self.bsnd(qk.input(0)?);
        let kt = qk.input(1)?;
        let k = match self
            .made_by(kt, "Transpose")
            .and_then(|(_, t)| t.ints("perm"))
        {
            Some(p) if p == [0, 2, 3, 1] => {
                Expr::Value(self.producing(kt)?.1.input(0)?.to_string())
            }
            Some(p) if p == [0, 1, 3, 2] => {
                self.bsnd(&self.unrepeated(self.producing(kt)?.1.input(0)?))
            }
            _ => Expr::Transpose(Box::new(Expr::Value(kt.to_string())), vec![0, 3, 1, 2]),
        };
        let v = self.bsnd(&self.unrepeated(pv.input(1)?));
        let (qd, kd, vd) = (
            self.expr_dims(&q)?,
            self.expr_dims(&k)?,
            self.expr_dims(&v)?,
        );
        let ok = qd.len() == 4
            && kd.len() == 4
            && vd.len() == 4
            && qd[0] == kd[0]
            && qd[3] == kd[3]
            && kd[..3] == vd[..3]
            && kd[2] > 0
            && qd[2] % kd[2] == 0;
        ok.then_some(Raised::Attention {
            q,
            k,
            v,
            causal,
            scale,
        })
    }

    fn expr_dims(&self, e: &Expr) -> Option<Vec<usize>> {
        match e {
            Expr::Value(v) => self.dims_of(v),
            Expr::Rotary(e, _) => self.expr_dims(e),
            Expr::Transpose(e, p) => {
                let d = self.expr_dims(e)?;
                p.iter().map(|&k| d.get(k).copied()).collect()
            }
        }
    }

    /// `(y, causal)`: the logits before a causal mask, or `z` itself unmasked.
    fn unmasked(&self, z: &str) -> Option<(String, bool)> {
        let future = |m: &super::tensor::HostTensor,
                      masked: &dyn Fn(f64) -> bool,
                      open: &dyn Fn(f64) -> bool| {
            let r = m.dims.len();
            if r < 2 || m.dims[..r - 2].iter().any(|&k| k != 1) {
                return false;
            }
            let (rows, cols) = (m.dims[r - 2], m.dims[r - 1]);
            (0..rows * cols).all(|k| {
                let (i, j) = (k / cols, k % cols);
                let x = m.data.f64(k);
                if j > i { masked(x) } else { open(x) }
            })
        };
        let very_negative = |x: f64| x <= -1e30;
        if let Some((_, w)) = self.made_by(z, "Where") {
            let m = self.vals.get(w.input(0)?)?.known()?;
            let fill = self.scalar(w.input(1)?)?;
            let ok = very_negative(fill) && future(m, &|x| x != 0.0, &|x| x == 0.0);
            return ok.then(|| (w.inputs[2].clone(), true));
        }
        if let Some((_, add)) = self.made_by(z, "Add") {
            let found = Self::pairs(add).into_iter().find_map(|(y, mask)| {
                let m = self.vals.get(&mask)?.known()?;
                future(m, &very_negative, &|x| x == 0.0).then_some(y)
            });
            if let Some(y) = found {
                return Some((y, true));
            }
        }
        Some((z.to_string(), false))
    }

    /// `(s, scale)`: the logits `s` before a scalar scale.
    fn unscaled(&self, y: &str) -> (String, f64) {
        if let Some((_, mul)) = self.made_by(y, "Mul") {
            for (s, c) in Self::pairs(mul) {
                if let Some(c) = self.scalar(&c) {
                    return (s, c);
                }
            }
        }
        if let Some((_, div)) = self.made_by(y, "Div")
            && let (Some(s), Some(c)) = (div.input(0), div.input(1).and_then(|c| self.scalar(c)))
            && c != 0.0
        {
            return (s.to_string(), 1.0 / c);
        }
        (y.to_string(), 1.0)
    }

    fn try_head(&mut self, n: &NodeRec, last_output: &str) -> Option<Raised> {
        if n.op != "MatMul" || n.outputs.first()? != last_output {
            return None;
        }
        let (x, w) = (n.input(0)?.to_string(), n.input(1)?.to_string());
        let (xd, wd) = (self.dims_of(&x)?, self.dims_of(&w)?);
        if !self.is_param(&w) || wd.len() != 2 || xd.len() != 3 || xd[2] != wd[0] {
            return None;
        }
        // A head tied to the token embedding was un-tied by the exporter's constant folding
        // of the transpose: find the table it is the transpose of.
        let w_vals = self.vals.get(&w)?.known()?.clone();
        let tied = self.nodes.iter().find_map(|g| {
            if g.op != "Gather" {
                return None;
            }
            let table = g.input(0)?;
            let t = self.vals.get(table)?.known()?;
            let same = t.dims == [wd[1], wd[0]]
                && (0..wd[0]).all(|a| {
                    (0..wd[1]).all(|b| t.data.f64(b * wd[0] + a) == w_vals.data.f64(a * wd[1] + b))
                });
            (same && self.is_param(table)).then(|| table.to_string())
        });
        match tied {
            Some(table) => {
                self.tied.insert(w.clone(), table);
            }
            None => {
                self.param_transposed.insert(w.clone());
            }
        }
        Some(Raised::Head { x, w })
    }
}

/// Finds every pattern, keyed by root node.
pub(crate) fn find(im: &mut Importer) -> HashMap<usize, Raised> {
    let mut raised = HashMap::new();
    let last_output = im
        .nodes
        .iter()
        .rev()
        .flat_map(|n| n.outputs.first())
        .next()
        .cloned()
        .unwrap_or_default();
    let last_output = im
        .uses
        .iter()
        .find(|_| false)
        .map(|(k, _)| k.clone())
        .unwrap_or(last_output);
    let mut attention_outputs = Vec::new();
    for i in 0..im.nodes.len() {
        let n = im.nodes[i].clone();
        if !n
            .outputs
            .first()
            .is_some_and(|o| matches!(im.vals.get(o), Some(Val::Dyn(_))))
        {
            continue;
        }
        let r = im
            .try_rms(&n)
            .or_else(|| im.try_layer_norm(&n))
            .or_else(|| im.try_gelu(&n))
            .or_else(|| im.try_silu(&n))
            .or_else(|| im.try_attention(&n))
            .or_else(|| im.try_projection(&n))
            .or_else(|| im.try_out_projection(&n, &attention_outputs))
            .or_else(|| im.try_head(&n, &last_output));
        if let Some(r) = r {
            if matches!(r, Raised::Attention { .. }) {
                attention_outputs.push(n.outputs[0].clone());
            }
            raised.insert(i, r);
        }
    }
    raised
}

/// A norm found in the graph.
struct Norm {
    start: usize,
    root: usize,
    x: String,
    out: String,
    params: Vec<String>,
}

/// Reads the layers, parts and roles off the raised graph.
pub(crate) fn structure(
    im: &Importer,
    raised: &HashMap<usize, Raised>,
    inputs: &[(String, TensorType)],
    outputs: &[String],
) -> Structure {
    let mut st = Structure::default();
    // Norms in node order: raised RMS norms (spanning back to their first node) and native
    // layer norms.
    let mut norms: Vec<Norm> = Vec::new();
    for (i, n) in im.nodes.iter().enumerate() {
        let out = n.outputs.first().cloned().unwrap_or_default();
        match raised.get(&i) {
            Some(Raised::RmsNorm { x, gamma, .. } | Raised::LayerNorm { x, gamma, .. }) => {
                // The norm starts at the first node that reads `x` on the way to the root.
                let start = (0..i)
                    .find(|&k| {
                        im.nodes[k].inputs.iter().any(|v| v == x)
                            && im.nodes[k].outputs.iter().any(|o| depends_on(im, i, o))
                    })
                    .unwrap_or(i);
                let mut params = vec![gamma.clone()];
                if let Some(Raised::LayerNorm { beta, .. }) = raised.get(&i) {
                    params.push(beta.clone());
                }
                norms.push(Norm {
                    start,
                    root: i,
                    x: x.clone(),
                    out,
                    params,
                });
            }
            None if n.op == "LayerNormalization" => {
                *st.native.entry("layer_norm".into()).or_default() += 1;
                let params = n
                    .inputs
                    .iter()
                    .skip(1)
                    .filter(|v| im.is_param(v))
                    .cloned()
                    .collect();
                norms.push(Norm {
                    start: i,
                    root: i,
                    x: n.inputs[0].clone(),
                    out,
                    params,
                });
            }
            _ => {}
        }
    }
    for n in &norms {
        for p in &n.params {
            st.roles.insert(p.clone(), WeightRole::Norm);
        }
    }
    let mut attentions: Vec<usize> = raised
        .iter()
        .filter(|(_, r)| matches!(r, Raised::Attention { .. }))
        .map(|(&i, _)| i)
        .collect();
    attentions.sort_unstable();

    // Embedding: token lookups of graph inputs, position lookups of constant indices.
    for n in &im.nodes {
        if n.op != "Gather" {
            continue;
        }
        let (Some(table), Some(ids)) = (n.input(0), n.input(1)) else {
            continue;
        };
        if !im.is_param(table) {
            continue;
        }
        if let Some((_, ty)) = inputs.iter().find(|(name, _)| name == ids) {
            let vocab = im
                .vals
                .get(table)
                .map(|v| v.dims())
                .and_then(|d| d.first().copied());
            if let Some(vocab) = vocab {
                st.roles
                    .insert(table.to_string(), WeightRole::TokenEmbedding);
                st.input_roles
                    .insert(ids.to_string(), InputRole::Tokens { vocab });
                st.token_dtype = Some(match ty.dtype {
                    DType::I64 if vocab <= i32::MAX as usize => DType::I32,
                    d => d,
                });
            }
        } else if im.vals.get(ids).and_then(Val::known).is_some() {
            st.roles
                .insert(table.to_string(), WeightRole::PositionEmbedding);
        }
    }
    for (&i, r) in raised {
        if let Raised::Head { w, .. } = r
            && !im.tied.contains_key(w)
        {
            st.roles.insert(w.clone(), WeightRole::Head);
        }
        let _ = i;
    }

    if attentions.is_empty() {
        if !im.nodes.is_empty() {
            st.not_understood
                .push("no attention was recognised: the model has no blocks".into());
        }
        return st;
    }
    st.layers.push((0, Some(LayerId::Embedding)));
    let norm_before = |root: usize| norms.iter().rposition(|n| n.root < root);
    let mut starts = Vec::new();
    for (k, &a) in attentions.iter().enumerate() {
        match norm_before(a) {
            Some(ni) => starts.push((ni, norms[ni].start)),
            None => {
                st.not_understood
                    .push(format!("block {k}: no norm before its attention"));
                return st;
            }
        }
    }
    let last_attention = *attentions.last().unwrap_or(&0);
    let after: Vec<usize> = (0..norms.len())
        .filter(|&k| norms[k].root > last_attention)
        .collect();
    let final_norm = (after.len() >= 2).then(|| after[after.len() - 1]);
    let end = final_norm.map_or(im.nodes.len(), |f| norms[f].start);
    st.blocks = attentions.len();
    for (k, &a) in attentions.iter().enumerate() {
        let (n1, start) = starts[k];
        let block_end = starts.get(k + 1).map_or(end, |s| s.1);
        st.layers.push((start, Some(LayerId::Block(k as u32))));
        block_parts(im, raised, &norms, n1, a, block_end, k, &mut st);
    }
    if let Some(f) = final_norm {
        st.layers.push((norms[f].start, Some(LayerId::FinalNorm)));
        for i in norms[f].start..=norms[f].root {
            st.parts.insert(i, Part::Norm);
        }
        st.layers.push((norms[f].root + 1, Some(LayerId::Head)));
    } else {
        st.not_understood
            .push("no final norm after the last block".into());
    }
    let _ = outputs;
    st
}

/// Whether `value` is read (through computed values) by node `root`, within 16 steps.
fn depends_on(im: &Importer, root: usize, value: &str) -> bool {
    let mut frontier: std::collections::BTreeSet<String> =
        im.nodes[root].inputs.iter().cloned().collect();
    for _ in 0..16 {
        if frontier.contains(value) {
            return true;
        }
        frontier = frontier
            .iter()
            .filter_map(|v| im.producing(v))
            .flat_map(|(_, n)| n.inputs.clone())
            .collect();
        if frontier.is_empty() {
            return false;
        }
    }
    false
}

/// The parts and weight roles of block `k`: its attention norm `norms[n1]`, attention
/// `attention`, the residual add after it, the MLP norm and the MLP up to `end`.
#[allow(clippy::too_many_arguments)]
fn block_parts(
    im: &Importer,
    raised: &HashMap<usize, Raised>,
    norms: &[Norm],
    n1: usize,
    attention: usize,
    end: usize,
    k: usize,
    st: &mut Structure,
) {
    let norm1 = &norms[n1];
    for i in norm1.start..=norm1.root {
        st.parts.insert(i, Part::Norm);
    }
    // Q, K and V: the projections whose outputs attention reads.
    if let Some(Raised::Attention { q, k: key, v, .. }) = raised.get(&attention) {
        for (e, role) in [
            (q, WeightRole::Query),
            (key, WeightRole::Key),
            (v, WeightRole::Value),
        ] {
            let mut leaves = Vec::new();
            e.leaves(&mut leaves);
            for leaf in leaves {
                if let Some((p, _)) = im.producing(&leaf)
                    && let Some(Raised::Projection { w, b, .. }) = raised.get(&p)
                {
                    st.roles.insert(w.clone(), role);
                    if let Some(b) = b {
                        st.roles.insert(b.clone(), role);
                    }
                }
            }
        }
    }
    let residual = |from: usize, x: &str| {
        (from..end).find(|&i| im.nodes[i].op == "Add" && im.nodes[i].inputs.iter().any(|v| v == x))
    };
    let Some(r1) = residual(attention + 1, &norm1.x) else {
        st.not_understood
            .push(format!("block {k}: no residual add after its attention"));
        return;
    };
    for i in norm1.root + 1..r1 {
        st.parts.insert(i, Part::Attention);
        if let Some(Raised::OutProjection { w, .. }) = raised.get(&i) {
            st.roles.insert(w.clone(), WeightRole::AttentionOut);
        }
    }
    mark_biases(im, norm1.root + 1, r1, WeightRole::AttentionOut, st);
    let r1_out = im.nodes[r1].outputs.first().cloned().unwrap_or_default();
    let Some(n2) = norms
        .iter()
        .find(|n| n.start > r1 && n.x == r1_out && n.root < end)
    else {
        st.not_understood
            .push(format!("block {k}: no norm before its MLP"));
        return;
    };
    for i in n2.start..=n2.root {
        st.parts.insert(i, Part::Norm);
    }
    let Some(r2) = residual(n2.root + 1, &r1_out) else {
        st.not_understood
            .push(format!("block {k}: no residual add after its MLP"));
        return;
    };
    let silu_inputs: Vec<&String> = (n2.root + 1..r2)
        .filter_map(|i| match raised.get(&i) {
            Some(Raised::Silu { x }) => Some(x),
            _ => None,
        })
        .collect();
    let mut found_out = false;
    for i in n2.root + 1..r2 {
        st.parts.insert(i, Part::Mlp);
        let n = &im.nodes[i];
        if n.op != "MatMul" || raised.contains_key(&i) {
            continue;
        }
        let (Some(x), Some(w)) = (n.input(0), n.input(1)) else {
            continue;
        };
        if !im.is_param(w) {
            continue;
        }
        let out = n.outputs.first().cloned().unwrap_or_default();
        let role = if x == n2.out {
            let gates = silu_inputs
                .iter()
                .any(|s| **s == out || bias_of(im, &out).as_ref() == Some(*s));
            if gates {
                WeightRole::MlpGate
            } else {
                WeightRole::MlpIn
            }
        } else {
            found_out = true;
            WeightRole::MlpOut
        };
        st.roles.insert(w.to_string(), role);
        if let Some(add) = bias_node(im, &out) {
            for v in &im.nodes[add].inputs {
                if im.is_param(v) && im.vals.get(v).is_some_and(|v| v.dims().len() == 1) {
                    st.roles.insert(v.clone(), role);
                }
            }
        }
    }
    if !found_out {
        st.not_understood
            .push(format!("block {k}: no MLP output projection"));
    }
}

/// The node adding a 1-D initializer to `v` (a bias), if `v`'s only reader is one.
fn bias_node(im: &Importer, v: &str) -> Option<usize> {
    im.nodes.iter().position(|n| {
        n.op == "Add"
            && n.inputs.iter().any(|x| x == v)
            && n.inputs
                .iter()
                .any(|x| im.is_param(x) && im.vals.get(x).is_some_and(|t| t.dims().len() == 1))
    })
}

/// The output of the bias add after `v`.
fn bias_of(im: &Importer, v: &str) -> Option<String> {
    bias_node(im, v).and_then(|i| im.nodes[i].outputs.first().cloned())
}

/// Gives the 1-D initializers added in nodes `from..to` (biases) `role`.
fn mark_biases(im: &Importer, from: usize, to: usize, role: WeightRole, st: &mut Structure) {
    for i in from..to {
        let n = &im.nodes[i];
        if n.op != "Add" {
            continue;
        }
        for v in &n.inputs {
            if im.is_param(v)
                && im.vals.get(v).is_some_and(|t| t.dims().len() == 1)
                && !st.roles.contains_key(v)
            {
                st.roles.insert(v.clone(), role);
            }
        }
    }
}
