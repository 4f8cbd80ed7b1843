//! Ops written as fusion bodies computed in f32: softmax, layer and RMS norm, and the SGD and
//! AdamW updates. The reference computes each of them in f64 and rounds only its results;
//! here the intermediates are f32 (unrounded to a narrower compute dtype) and the results
//! are cast to the declared dtype once, which is the closest f32 equivalent.

use autopar_ir::infer::infer;
use autopar_ir::{
    BinaryOp, DType, FusedInstr, FusionBody, Op, ReduceOp, Shape, TensorType, UnaryOp,
};

use super::require_float;
use crate::error::CudaError;

/// Builds a body instruction by instruction, each typed by the IR's rule.
struct Builder {
    body: FusionBody,
    types: Vec<TensorType>,
}

impl Builder {
    fn new(params: &[&TensorType]) -> Self {
        let params: Vec<TensorType> = params.iter().map(|t| (*t).clone()).collect();
        Builder {
            types: params.clone(),
            body: FusionBody {
                params,
                instrs: Vec::new(),
                results: Vec::new(),
            },
        }
    }

    fn push(&mut self, op: Op, operands: &[usize]) -> Result<usize, CudaError> {
        let args: Vec<&TensorType> = operands.iter().map(|&v| &self.types[v]).collect();
        let mut out = infer(&op, &args, None).map_err(|e| CudaError::Runtime(e.into()))?;
        self.types.push(out.remove(0));
        self.body.instrs.push(FusedInstr {
            op,
            operands: operands.to_vec(),
        });
        Ok(self.types.len() - 1)
    }

    fn ty(&self, v: usize) -> &TensorType {
        &self.types[v]
    }

    fn cast(&mut self, v: usize, to: DType) -> Result<usize, CudaError> {
        if self.ty(v).dtype == to {
            return Ok(v);
        }
        self.push(Op::Cast { to }, &[v])
    }

    fn unary(&mut self, func: UnaryOp, v: usize) -> Result<usize, CudaError> {
        self.push(Op::Unary { func }, &[v])
    }

    fn binary(&mut self, func: BinaryOp, a: usize, b: usize) -> Result<usize, CudaError> {
        self.push(Op::Binary { func }, &[a, b])
    }

    fn reduce(&mut self, func: ReduceOp, v: usize, dims: Vec<usize>) -> Result<usize, CudaError> {
        self.push(Op::Reduce { func, dims }, &[v])
    }

    /// `v` broadcast to `shape`, its dims going to `dims`.
    fn broadcast(
        &mut self,
        v: usize,
        shape: &[usize],
        dims: Vec<usize>,
    ) -> Result<usize, CudaError> {
        if self.ty(v).dims() == shape {
            return Ok(v);
        }
        self.push(
            Op::Broadcast {
                shape: Shape::new(shape.to_vec()),
                dims,
            },
            &[v],
        )
    }

    /// An f32 constant of `shape`.
    fn constant(&mut self, shape: &[usize], value: f64) -> Result<usize, CudaError> {
        self.push(
            Op::Constant {
                ty: TensorType::new(DType::F32, shape.to_vec()),
                value,
            },
            &[],
        )
    }

    /// `c * v` with an f32 constant.
    fn scale(&mut self, c: f64, v: usize) -> Result<usize, CudaError> {
        let shape = self.ty(v).dims().to_vec();
        let k = self.constant(&shape, c)?;
        self.binary(BinaryOp::Mul, k, v)
    }

    fn finish(mut self, results: Vec<usize>) -> FusionBody {
        self.body.results = results;
        self.body
    }
}

/// Every dim of a rank-`rank` shape but `skip`.
fn all_but(rank: usize, skip: usize) -> Vec<usize> {
    (0..rank).filter(|&d| d != skip).collect()
}

/// `exp(x - max) / sum(exp(x - max))` along `dim`.
pub fn softmax(dim: usize, x: &TensorType) -> Result<FusionBody, CudaError> {
    require_float("softmax", x.dtype)?;
    let mut b = Builder::new(&[x]);
    let shape = x.dims().to_vec();
    let x32 = b.cast(0, DType::F32)?;
    let max = b.reduce(ReduceOp::Max, x32, vec![dim])?;
    let maxb = b.broadcast(max, &shape, all_but(shape.len(), dim))?;
    let centred = b.binary(BinaryOp::Sub, x32, maxb)?;
    let e = b.unary(UnaryOp::Exp, centred)?;
    let sum = b.reduce(ReduceOp::Sum, e, vec![dim])?;
    let sumb = b.broadcast(sum, &shape, all_but(shape.len(), dim))?;
    let y = b.binary(BinaryOp::Div, e, sumb)?;
    let y = b.cast(y, x.dtype)?;
    Ok(b.finish(vec![y]))
}

/// The operands `x[..., h]`, `gamma[h]` in f32, the row shape and the last dim.
fn norm_start(b: &mut Builder, x: &TensorType) -> Result<(usize, Vec<usize>, usize), CudaError> {
    let rank = x.rank();
    if rank == 0 {
        return Err(CudaError::Unsupported {
            op: "norm",
            operands: x.to_string(),
            detail: "a norm needs at least one dim".into(),
        });
    }
    let x32 = b.cast(0, DType::F32)?;
    Ok((x32, x.dims()[..rank - 1].to_vec(), rank - 1))
}

/// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last dim (biased variance).
pub fn layer_norm(eps: f64, operands: &[&TensorType]) -> Result<FusionBody, CudaError> {
    let x = operands[0];
    require_float("layer_norm", x.dtype)?;
    let mut b = Builder::new(operands);
    let shape = x.dims().to_vec();
    let (x32, rows, last) = norm_start(&mut b, x)?;
    let kept: Vec<usize> = (0..last).collect();
    let mean = b.reduce(ReduceOp::Mean, x32, vec![last])?;
    let meanb = b.broadcast(mean, &shape, kept.clone())?;
    let xc = b.binary(BinaryOp::Sub, x32, meanb)?;
    let sq = b.unary(UnaryOp::Square, xc)?;
    let var = b.reduce(ReduceOp::Mean, sq, vec![last])?;
    let e = b.constant(&rows, eps)?;
    let var_eps = b.binary(BinaryOp::Add, var, e)?;
    let inv = b.unary(UnaryOp::Rsqrt, var_eps)?;
    let invb = b.broadcast(inv, &shape, kept)?;
    let normed = b.binary(BinaryOp::Mul, xc, invb)?;
    let g = b.cast(1, DType::F32)?;
    let gb = b.broadcast(g, &shape, vec![last])?;
    let beta = b.cast(2, DType::F32)?;
    let betab = b.broadcast(beta, &shape, vec![last])?;
    let scaled = b.binary(BinaryOp::Mul, normed, gb)?;
    let y = b.binary(BinaryOp::Add, scaled, betab)?;
    let y = b.cast(y, x.dtype)?;
    Ok(b.finish(vec![y]))
}

/// `x / sqrt(mean(x^2) + eps) * gamma` over the last dim.
pub fn rms_norm(eps: f64, operands: &[&TensorType]) -> Result<FusionBody, CudaError> {
    let x = operands[0];
    require_float("rms_norm", x.dtype)?;
    let mut b = Builder::new(operands);
    let shape = x.dims().to_vec();
    let (x32, rows, last) = norm_start(&mut b, x)?;
    let sq = b.unary(UnaryOp::Square, x32)?;
    let ms = b.reduce(ReduceOp::Mean, sq, vec![last])?;
    let e = b.constant(&rows, eps)?;
    let ms_eps = b.binary(BinaryOp::Add, ms, e)?;
    let inv = b.unary(UnaryOp::Rsqrt, ms_eps)?;
    let invb = b.broadcast(inv, &shape, (0..last).collect())?;
    let normed = b.binary(BinaryOp::Mul, x32, invb)?;
    let g = b.cast(1, DType::F32)?;
    let gb = b.broadcast(g, &shape, vec![last])?;
    let y = b.binary(BinaryOp::Mul, normed, gb)?;
    let y = b.cast(y, x.dtype)?;
    Ok(b.finish(vec![y]))
}

/// `m' = momentum m + g`, `p' = p (1 - lr wd) - lr m'`; results `[p', m']`.
pub fn sgd(
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    operands: &[&TensorType],
) -> Result<FusionBody, CudaError> {
    let dtype = operands[0].dtype;
    require_float("sgd_update", dtype)?;
    let mut b = Builder::new(operands);
    let p = b.cast(0, DType::F32)?;
    let g = b.cast(1, DType::F32)?;
    let m = b.cast(2, DType::F32)?;
    let mm = b.scale(momentum, m)?;
    let new_m = b.binary(BinaryOp::Add, mm, g)?;
    let decayed = b.scale(1.0 - lr * weight_decay, p)?;
    let step = b.scale(lr, new_m)?;
    let new_p = b.binary(BinaryOp::Sub, decayed, step)?;
    let new_p = b.cast(new_p, dtype)?;
    let new_m = b.cast(new_m, dtype)?;
    Ok(b.finish(vec![new_p, new_m]))
}

/// AdamW's hyper-parameters.
#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

/// AdamW on `param, grad, m, v` and the f32 step count; results `[p', m', v']`.
pub fn adamw(h: AdamW, operands: &[&TensorType]) -> Result<FusionBody, CudaError> {
    let dtype = operands[0].dtype;
    require_float("adamw_update", dtype)?;
    let mut b = Builder::new(operands);
    let shape = operands[0].dims().to_vec();
    let p = b.cast(0, DType::F32)?;
    let g = b.cast(1, DType::F32)?;
    let m = b.cast(2, DType::F32)?;
    let v = b.cast(3, DType::F32)?;
    let t = b.cast(4, DType::F32)?;
    let t = b.broadcast(t, &shape, Vec::new())?;
    let bm = b.scale(h.beta1, m)?;
    let bg = b.scale(1.0 - h.beta1, g)?;
    let new_m = b.binary(BinaryOp::Add, bm, bg)?;
    let g2 = b.unary(UnaryOp::Square, g)?;
    let bv = b.scale(h.beta2, v)?;
    let bg2 = b.scale(1.0 - h.beta2, g2)?;
    let new_v = b.binary(BinaryOp::Add, bv, bg2)?;
    let one = b.constant(&shape, 1.0)?;
    let b1 = b.constant(&shape, h.beta1)?;
    let b2 = b.constant(&shape, h.beta2)?;
    let b1t = b.binary(BinaryOp::Pow, b1, t)?;
    let b2t = b.binary(BinaryOp::Pow, b2, t)?;
    let bias1 = b.binary(BinaryOp::Sub, one, b1t)?;
    let bias2 = b.binary(BinaryOp::Sub, one, b2t)?;
    let m_hat = b.binary(BinaryOp::Div, new_m, bias1)?;
    let v_hat = b.binary(BinaryOp::Div, new_v, bias2)?;
    let root = b.unary(UnaryOp::Sqrt, v_hat)?;
    let eps = b.constant(&shape, h.eps)?;
    let denom = b.binary(BinaryOp::Add, root, eps)?;
    let ratio = b.binary(BinaryOp::Div, m_hat, denom)?;
    let step = b.scale(h.lr, ratio)?;
    let decayed = b.scale(1.0 - h.lr * h.weight_decay, p)?;
    let new_p = b.binary(BinaryOp::Sub, decayed, step)?;
    let new_p = b.cast(new_p, dtype)?;
    let new_m = b.cast(new_m, dtype)?;
    let new_v = b.cast(new_v, dtype)?;
    Ok(b.finish(vec![new_p, new_m, new_v]))
}
