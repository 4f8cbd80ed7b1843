//! Hugging Face weights in and out: GPT-2 (`GPT2LMHeadModel`) and Llama (`LlamaForCausalLM`)
//! safetensors files mapped onto the zoo's `gpt:` and `llama:` models of the same shape.
//!
//! The mapping is by tensor name, one table per family, with the layouts converted:
//! GPT-2's `Conv1D` weights are stored `[in, out]`, as the zoo's are, so its fused
//! `c_attn` is only split into query, key and value and reshaped to `[hidden, heads,
//! head_dim]`; Llama's `nn.Linear` weights are `[out, in]` and are transposed. GPT-2's
//! position table is cut to the model's sequence length, and its output layer is the token
//! embedding (tied). Buffers that are not weights (causal masks, rotary frequencies) are
//! skipped; any other tensor without a counterpart, a model weight the file lacks, or a
//! shape that does not fit is an error naming both tensors.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use autopar_ir::{DType, TensorType};
use autopar_runtime::{Tensor, TensorMap};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

use super::checkpoint_error as bad;
use super::encode;
use crate::Error;

/// The model families whose Hugging Face checkpoints map onto zoo models.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// GPT-2: the zoo's `gpt:` models.
    Gpt2,
    /// Llama: the zoo's `llama:` models.
    Llama,
}

/// A weight as a row-major matrix of any rank being converted.
#[derive(Clone, Debug, PartialEq)]
struct Array {
    dims: Vec<usize>,
    values: Vec<f64>,
}

impl Array {
    fn transpose2(&self) -> Array {
        let (r, c) = (self.dims[0], self.dims[1]);
        let mut values = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                values[j * r + i] = self.values[i * c + j];
            }
        }
        Array {
            dims: vec![c, r],
            values,
        }
    }

    /// Columns `k * width .. (k + 1) * width` of a matrix (or elements of a vector).
    fn columns(&self, k: usize, width: usize) -> Array {
        let cols = *self.dims.last().unwrap_or(&1);
        let rows = self.values.len() / cols.max(1);
        let mut values = Vec::with_capacity(rows * width);
        for i in 0..rows {
            values
                .extend_from_slice(&self.values[i * cols + k * width..i * cols + (k + 1) * width]);
        }
        let mut dims = self.dims.clone();
        if let Some(last) = dims.last_mut() {
            *last = width;
        }
        Array { dims, values }
    }

    fn concat_columns(parts: &[Array]) -> Array {
        let rows = parts[0].values.len() / parts[0].dims.last().copied().unwrap_or(1).max(1);
        let mut values = Vec::new();
        for i in 0..rows {
            for p in parts {
                let w = *p.dims.last().unwrap_or(&1);
                values.extend_from_slice(&p.values[i * w..(i + 1) * w]);
            }
        }
        let mut dims = parts[0].dims.clone();
        if let Some(last) = dims.last_mut() {
            *last = parts.iter().map(|p| *p.dims.last().unwrap_or(&1)).sum();
        }
        Array { dims, values }
    }

    fn reshape(mut self, dims: &[usize]) -> Option<Array> {
        (dims.iter().product::<usize>() == self.values.len()).then(|| {
            self.dims = dims.to_vec();
            self
        })
    }

    fn rows(&self, n: usize) -> Array {
        let w: usize = self.dims[1..].iter().product();
        let mut dims = self.dims.clone();
        dims[0] = n;
        Array {
            dims,
            values: self.values[..n * w].to_vec(),
        }
    }
}

/// How one Hugging Face tensor becomes zoo weights.
enum Rule {
    /// The same tensor under another name.
    Same(String),
    /// Transposed (`nn.Linear`'s `[out, in]` to `[in, out]`), then reshaped to the zoo's.
    Transposed(String),
    /// Split into equal column blocks, one per zoo weight, each reshaped (GPT-2's `c_attn`).
    Split(Vec<String>),
    /// The first rows, as many as the zoo's tensor has (GPT-2's position table).
    Rows(String),
    /// Must equal another tensor of the file (a tied output layer).
    TiedTo(&'static str),
    /// A buffer, not a weight.
    Skip,
}

/// The zoo name a Hugging Face name maps to, or `None` when it has no counterpart.
fn rule(family: Family, name: &str) -> Option<Rule> {
    let same = |s: String| Some(Rule::Same(s));
    match family {
        Family::Gpt2 => {
            let name = name.strip_prefix("transformer.").unwrap_or(name);
            match name {
                "wte.weight" => return same("wte".into()),
                "wpe.weight" => return Some(Rule::Rows("wpe".into())),
                "ln_f.weight" => return same("ln_f.g".into()),
                "ln_f.bias" => return same("ln_f.b".into()),
                "lm_head.weight" => return Some(Rule::TiedTo("wte")),
                _ => {}
            }
            let (i, rest) = block(name.strip_prefix("h.")?)?;
            let p = |s: &str| format!("h.{i}.{s}");
            match rest {
                "ln_1.weight" => same(p("ln1.g")),
                "ln_1.bias" => same(p("ln1.b")),
                "ln_2.weight" => same(p("ln2.g")),
                "ln_2.bias" => same(p("ln2.b")),
                "attn.c_attn.weight" => {
                    Some(Rule::Split(vec![p("attn.wq"), p("attn.wk"), p("attn.wv")]))
                }
                "attn.c_attn.bias" => {
                    Some(Rule::Split(vec![p("attn.bq"), p("attn.bk"), p("attn.bv")]))
                }
                "attn.c_proj.weight" => same(p("attn.wo")),
                "attn.c_proj.bias" => same(p("attn.bo")),
                "mlp.c_fc.weight" => same(p("mlp.w1")),
                "mlp.c_fc.bias" => same(p("mlp.b1")),
                "mlp.c_proj.weight" => same(p("mlp.w2")),
                "mlp.c_proj.bias" => same(p("mlp.b2")),
                "attn.bias" | "attn.masked_bias" => Some(Rule::Skip),
                _ => None,
            }
        }
        Family::Llama => {
            if name == "lm_head.weight" {
                return same("lm_head".into());
            }
            let name = name.strip_prefix("model.").unwrap_or(name);
            match name {
                "embed_tokens.weight" => return same("tok_embeddings".into()),
                "norm.weight" => return same("norm_f.g".into()),
                _ => {}
            }
            let (i, rest) = block(name.strip_prefix("layers.")?)?;
            let p = |s: &str| format!("h.{i}.{s}");
            let t = |s: &str| Some(Rule::Transposed(p(s)));
            match rest {
                "input_layernorm.weight" => same(p("attn_norm.g")),
                "post_attention_layernorm.weight" => same(p("mlp_norm.g")),
                "self_attn.q_proj.weight" => t("attn.wq"),
                "self_attn.k_proj.weight" => t("attn.wk"),
                "self_attn.v_proj.weight" => t("attn.wv"),
                "self_attn.o_proj.weight" => t("attn.wo"),
                "mlp.gate_proj.weight" => t("mlp.w1"),
                "mlp.up_proj.weight" => t("mlp.w3"),
                "mlp.down_proj.weight" => t("mlp.w2"),
                "self_attn.rotary_emb.inv_freq" => Some(Rule::Skip),
                _ => None,
            }
        }
    }
}

/// `("3", "attn.c_attn.weight")` from `"3.attn.c_attn.weight"`.
fn block(s: &str) -> Option<(usize, &str)> {
    let (i, rest) = s.split_once('.')?;
    Some((i.parse().ok()?, rest))
}

/// The family of a file's tensor names.
fn family_of<'a>(
    path: &Path,
    mut names: impl Iterator<Item = &'a str> + Clone,
) -> Result<Family, Error> {
    if names.clone().any(|n| n.ends_with("attn.c_attn.weight")) {
        Ok(Family::Gpt2)
    } else if names.any(|n| n.ends_with("self_attn.q_proj.weight")) {
        Ok(Family::Llama)
    } else {
        Err(bad(
            path,
            "holds neither GPT-2 (`h.N.attn.c_attn.weight`) nor Llama \
             (`model.layers.N.self_attn.q_proj.weight`) weights"
                .into(),
        ))
    }
}

/// Reads the Hugging Face weights in `path` as the zoo weights `expected` (name → global
/// type): every one of them must come from the file, and every tensor of the file must
/// become one of them (or be a known buffer).
pub fn load(
    path: &Path,
    expected: &BTreeMap<String, TensorType>,
) -> Result<(Family, TensorMap), Error> {
    let bytes = fs::read(path).map_err(|error| Error::Io {
        path: path.display().to_string(),
        error,
    })?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(path, format!("is not a safetensors file: {e}")))?;
    let mut names: Vec<&str> = st.names();
    names.sort_unstable();
    let family = family_of(path, names.iter().copied())?;
    let read = |name: &str| -> Result<Array, Error> {
        let view = st
            .tensor(name)
            .map_err(|e| bad(path, format!("cannot read `{name}`: {e}")))?;
        let ty = TensorType::new(DType::F32, view.shape().to_vec());
        let t = encode::from_bytes(&ty, view.dtype(), view.data())
            .map_err(|e| bad(path, format!("`{name}` {e}")))?;
        Ok(Array {
            dims: view.shape().to_vec(),
            values: t.to_f64_vec(),
        })
    };
    let mut out: BTreeMap<String, Array> = BTreeMap::new();
    let mut tied = Vec::new();
    for &name in &names {
        let rule = rule(family, name).ok_or_else(|| {
            bad(
                path,
                format!("holds `{name}`, which has no counterpart in the zoo's {family:?} models"),
            )
        })?;
        let target = |zoo: &str| {
            expected.get(zoo).ok_or_else(|| {
                bad(
                    path,
                    format!("holds `{name}`, but the model has no weight `{zoo}`"),
                )
            })
        };
        let fit = |a: Array, zoo: &str| -> Result<Array, Error> {
            let ty = target(zoo)?;
            let dims = a.dims.clone();
            a.reshape(ty.dims()).ok_or_else(|| {
                bad(
                    path,
                    format!(
                        "holds `{name}` with shape {dims:?}, which does not fit the model's \
                         `{zoo}` {ty}"
                    ),
                )
            })
        };
        match rule {
            Rule::Skip => {}
            Rule::TiedTo(other) => tied.push((name, other)),
            Rule::Same(zoo) => {
                let a = fit(read(name)?, &zoo)?;
                out.insert(zoo, a);
            }
            Rule::Transposed(zoo) => {
                let a = read(name)?;
                if a.dims.len() != 2 {
                    return Err(bad(path, format!("`{name}` is not a matrix: {:?}", a.dims)));
                }
                let a = fit(a.transpose2(), &zoo)?;
                out.insert(zoo, a);
            }
            Rule::Split(zoos) => {
                let a = read(name)?;
                let cols = *a.dims.last().unwrap_or(&0);
                if !cols.is_multiple_of(zoos.len()) || cols == 0 {
                    return Err(bad(
                        path,
                        format!(
                            "cannot split `{name}` {:?} into {} parts",
                            a.dims,
                            zoos.len()
                        ),
                    ));
                }
                for (k, zoo) in zoos.iter().enumerate() {
                    let part = fit(a.columns(k, cols / zoos.len()), zoo)?;
                    out.insert(zoo.clone(), part);
                }
            }
            Rule::Rows(zoo) => {
                let a = read(name)?;
                let want = target(&zoo)?.dims().first().copied().unwrap_or(0);
                if a.dims.is_empty() || a.dims[0] < want {
                    return Err(bad(
                        path,
                        format!(
                            "`{name}` has {} positions; the model needs {want}",
                            a.dims.first().unwrap_or(&0)
                        ),
                    ));
                }
                let a = fit(a.rows(want), &zoo)?;
                out.insert(zoo, a);
            }
        }
    }
    // A tied output layer: the file's copy must be the embedding itself.
    for (name, other) in tied {
        let a = read(name)?;
        if out
            .get(other)
            .is_some_and(|e| e.values != a.values || e.dims != a.dims)
        {
            return Err(bad(
                path,
                format!(
                    "holds an output layer `{name}` that differs from `{other}`, but the zoo's model ties them"
                ),
            ));
        }
    }
    // Llama with tied embeddings stores no separate output layer.
    if family == Family::Llama
        && !out.contains_key("lm_head")
        && expected.contains_key("lm_head")
        && let Some(e) = out.get("tok_embeddings").cloned()
    {
        out.insert("lm_head".into(), e);
    }
    if let Some(missing) = expected.keys().find(|k| !out.contains_key(*k)) {
        return Err(bad(
            path,
            format!("has no weights for the model's `{missing}`"),
        ));
    }
    let mut tensors = TensorMap::new();
    for (zoo, a) in out {
        let ty = expected[&zoo].clone();
        let t = Tensor::from_f64(ty, a.values)?.rounded();
        tensors.insert(zoo, t);
    }
    Ok((family, tensors))
}

/// The family of a set of zoo weight names.
pub fn family_of_zoo(names: &[&str]) -> Option<Family> {
    if names.contains(&"wte") && names.contains(&"wpe") {
        Some(Family::Gpt2)
    } else if names.contains(&"tok_embeddings") {
        Some(Family::Llama)
    } else {
        None
    }
}

/// One tensor of a Hugging Face file.
#[derive(Clone, Debug, PartialEq)]
pub struct HfTensor {
    /// Its name, as `transformers` spells it.
    pub name: String,
    /// Its shape.
    pub dims: Vec<usize>,
    /// Its elements, row-major.
    pub values: Vec<f32>,
}

/// The Hugging Face tensors of the zoo weights `weights`, named as `GPT2LMHeadModel` /
/// `LlamaForCausalLM` save them.
pub fn export(family: Family, weights: &BTreeMap<String, Tensor>) -> Result<Vec<HfTensor>, Error> {
    let get = |zoo: &str| -> Result<Array, Error> {
        let t = weights.get(zoo).ok_or_else(|| {
            Error::Usage(format!("the checkpoint has no weight `{zoo}` to export"))
        })?;
        Ok(Array {
            dims: t.dims().to_vec(),
            values: t.to_f64_vec(),
        })
    };
    // The zoo names of each block.
    let blocks = weights
        .keys()
        .filter_map(|k| block(k.strip_prefix("h.")?).map(|(i, _)| i))
        .max()
        .map_or(0, |i| i + 1);
    let mut out: Vec<(String, Array)> = Vec::new();
    let flat = |a: Array, rows: usize| -> Array {
        let n = a.values.len();
        Array {
            dims: vec![rows, n / rows.max(1)],
            values: a.values,
        }
    };
    match family {
        Family::Gpt2 => {
            let pre = |s: &str| format!("transformer.{s}");
            out.push((pre("wte.weight"), get("wte")?));
            out.push((pre("wpe.weight"), get("wpe")?));
            for i in 0..blocks {
                let z = |s: &str| get(&format!("h.{i}.{s}"));
                let h = |s: &str| pre(&format!("h.{i}.{s}"));
                let hidden = z("ln1.g")?.values.len();
                out.push((h("ln_1.weight"), z("ln1.g")?));
                out.push((h("ln_1.bias"), z("ln1.b")?));
                let qkv = [z("attn.wq")?, z("attn.wk")?, z("attn.wv")?].map(|a| flat(a, hidden));
                out.push((h("attn.c_attn.weight"), Array::concat_columns(&qkv)));
                let b = [z("attn.bq")?, z("attn.bk")?, z("attn.bv")?].map(|a| flat(a, 1));
                let mut bias = Array::concat_columns(&b);
                bias.dims = vec![bias.values.len()];
                out.push((h("attn.c_attn.bias"), bias));
                let wo = z("attn.wo")?;
                out.push((h("attn.c_proj.weight"), flat(wo, hidden)));
                out.push((h("attn.c_proj.bias"), z("attn.bo")?));
                out.push((h("ln_2.weight"), z("ln2.g")?));
                out.push((h("ln_2.bias"), z("ln2.b")?));
                out.push((h("mlp.c_fc.weight"), z("mlp.w1")?));
                out.push((h("mlp.c_fc.bias"), z("mlp.b1")?));
                out.push((h("mlp.c_proj.weight"), z("mlp.w2")?));
                out.push((h("mlp.c_proj.bias"), z("mlp.b2")?));
            }
            out.push((pre("ln_f.weight"), get("ln_f.g")?));
            out.push((pre("ln_f.bias"), get("ln_f.b")?));
        }
        Family::Llama => {
            out.push(("model.embed_tokens.weight".into(), get("tok_embeddings")?));
            for i in 0..blocks {
                let z = |s: &str| get(&format!("h.{i}.{s}"));
                let h = |s: &str| format!("model.layers.{i}.{s}");
                let hidden = z("attn_norm.g")?.values.len();
                out.push((h("input_layernorm.weight"), z("attn_norm.g")?));
                for (hf, zoo) in [
                    ("self_attn.q_proj.weight", "attn.wq"),
                    ("self_attn.k_proj.weight", "attn.wk"),
                    ("self_attn.v_proj.weight", "attn.wv"),
                ] {
                    out.push((h(hf), flat(z(zoo)?, hidden).transpose2()));
                }
                let wo = z("attn.wo")?;
                let rows = wo.values.len() / hidden.max(1);
                out.push((h("self_attn.o_proj.weight"), flat(wo, rows).transpose2()));
                out.push((h("post_attention_layernorm.weight"), z("mlp_norm.g")?));
                out.push((h("mlp.gate_proj.weight"), z("mlp.w1")?.transpose2()));
                out.push((h("mlp.up_proj.weight"), z("mlp.w3")?.transpose2()));
                out.push((h("mlp.down_proj.weight"), z("mlp.w2")?.transpose2()));
            }
            out.push(("model.norm.weight".into(), get("norm_f.g")?));
            out.push(("lm_head.weight".into(), get("lm_head")?));
        }
    }
    Ok(out
        .into_iter()
        .map(|(name, a)| HfTensor {
            name,
            dims: a.dims,
            values: a.values.iter().map(|&v| v as f32).collect(),
        })
        .collect())
}

/// Writes Hugging Face tensors as a safetensors file (`format: pt`, as `transformers`
/// writes them).
pub fn write(path: &Path, tensors: &[HfTensor]) -> Result<(), Error> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.values.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            TensorView::new(safetensors::Dtype::F32, t.dims.clone(), b).map(|v| (t.name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(path, format!("cannot encode: {e}")))?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let out = safetensors::serialize(views, Some(meta))
        .map_err(|e| bad(path, format!("cannot encode: {e}")))?;
    fs::write(path, out).map_err(|error| Error::Io {
        path: path.display().to_string(),
        error,
    })
}
