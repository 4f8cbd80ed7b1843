//! Model arguments as strings: a preset name with optional overrides (`llama3-8b:seq=4096`)
//! or a generic spec (`gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256`), parsed and checked
//! into a [`ModelConfig`]; and the canonical spec that every config prints as.
//!
//! Each config lists its keys once, as typed slots ([`ModelConfig::slots`]); parsing, the
//! range checks and printing all walk that one list.

use std::fmt;

use crate::error::FrontendError;
use crate::zoo::presets::{self, PRESETS};
use crate::zoo::{GptConfig, LlamaConfig, MlpConfig, Model, ModelConfig, MoeConfig};

/// The largest size any key (or the batch) may take: large enough for any real model, and
/// small enough that products such as `batch * seq` cannot overflow.
pub const MAX_SIZE: usize = 1 << 24;

/// The generic spec families, for listings and error messages.
pub(crate) const FAMILIES: &[(&str, &str)] = &[
    (
        "gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V[,ffn=F]",
        "any GPT (ffn defaults to 4*hidden)",
    ),
    (
        "llama:layers=L,hidden=H,heads=A,ffn=F,seq=S,vocab=V[,kv_heads=K,head_dim=D,rope_base=B]",
        "any Llama (kv_heads defaults to heads, head_dim to hidden/heads, rope_base to 10000)",
    ),
    (
        "moe:layers=L,hidden=H,heads=A,seq=S,vocab=V,experts=E,top_k=K[,ffn=F,capacity_factor=C,normalize=B,shared_ffn=F,style=gpt|llama]",
        "a GPT-style (default) or Llama-style (Mixtral) model with top-k routed MoE MLPs (and a shared expert of width shared_ffn)",
    ),
    ("mlp:in=I,hidden=H,out=O", "a two-layer MLP regressor"),
];

const GPT_REQUIRED: &[&str] = &["layers", "hidden", "heads", "seq", "vocab"];
const LLAMA_REQUIRED: &[&str] = &["layers", "hidden", "heads", "ffn", "seq", "vocab"];
const MOE_GPT_REQUIRED: &[&str] = &[
    "layers", "hidden", "heads", "seq", "vocab", "experts", "top_k",
];
const MOE_LLAMA_REQUIRED: &[&str] = &[
    "layers", "hidden", "heads", "ffn", "seq", "vocab", "experts", "top_k",
];
const MLP_REQUIRED: &[&str] = &["in", "hidden", "out"];

/// One settable field of a config, borrowed mutably, with how its value is written.
pub(crate) enum Slot<'a> {
    /// A positive size.
    Int(&'a mut usize),
    /// A positive size with a derived default when `None`.
    OptionalInt(&'a mut Option<usize>),
    /// A positive real number.
    Float(&'a mut f64),
    /// `true` or `false`.
    Bool(&'a mut bool),
}

impl ModelConfig {
    /// The config's keys, in canonical order, as mutable slots.
    pub(crate) fn slots(&mut self) -> Vec<(&'static str, Slot<'_>)> {
        use Slot::{Bool, Float, Int, OptionalInt};
        let (mut slots, moe) = match self {
            ModelConfig::Mlp(c) => (
                vec![
                    ("in", Int(&mut c.n_in)),
                    ("hidden", Int(&mut c.hidden)),
                    ("out", Int(&mut c.n_out)),
                ],
                None,
            ),
            ModelConfig::Gpt(c) => (
                vec![
                    ("layers", Int(&mut c.n_layers)),
                    ("hidden", Int(&mut c.hidden)),
                    ("heads", Int(&mut c.n_heads)),
                    ("seq", Int(&mut c.seq_len)),
                    ("vocab", Int(&mut c.vocab)),
                    ("ffn", OptionalInt(&mut c.ffn)),
                ],
                c.moe.as_mut(),
            ),
            ModelConfig::Llama(c) => (
                vec![
                    ("layers", Int(&mut c.n_layers)),
                    ("hidden", Int(&mut c.hidden)),
                    ("heads", Int(&mut c.n_heads)),
                    ("kv_heads", Int(&mut c.n_kv_heads)),
                    ("head_dim", OptionalInt(&mut c.head_dim)),
                    ("ffn", Int(&mut c.ffn)),
                    ("seq", Int(&mut c.seq_len)),
                    ("vocab", Int(&mut c.vocab)),
                    ("rope_base", Float(&mut c.rope_base)),
                ],
                c.moe.as_mut(),
            ),
        };
        if let Some(moe) = moe {
            slots.extend([
                ("experts", Int(&mut moe.n_experts)),
                ("top_k", Int(&mut moe.top_k)),
                ("capacity_factor", Float(&mut moe.capacity_factor)),
                ("normalize", Bool(&mut moe.normalize)),
                ("shared_ffn", OptionalInt(&mut moe.shared_ffn)),
            ]);
        }
        slots
    }

    /// The keys that a spec or a preset override may set for this model.
    pub fn keys(&self) -> Vec<&'static str> {
        self.clone().slots().into_iter().map(|(k, _)| k).collect()
    }

    /// The spec family and, for `moe`, the style: what the canonical spec starts with.
    fn family(&self) -> (&'static str, Option<&'static str>) {
        match self {
            ModelConfig::Mlp(_) => ("mlp", None),
            ModelConfig::Gpt(GptConfig { moe: None, .. }) => ("gpt", None),
            ModelConfig::Gpt(_) => ("moe", Some("gpt")),
            ModelConfig::Llama(LlamaConfig { moe: None, .. }) => ("llama", None),
            ModelConfig::Llama(_) => ("moe", Some("llama")),
        }
    }

    /// Checks every size and every relation between sizes; `model` names the model in errors.
    pub fn validate(&self, model: &str) -> Result<(), FrontendError> {
        for (key, slot) in self.clone().slots() {
            match slot {
                Slot::Int(v) | Slot::OptionalInt(Some(v)) => check_size(model, key, *v)?,
                Slot::Float(v) if !(v.is_finite() && *v > 0.0) => {
                    return Err(FrontendError::InvalidConfig {
                        model: model.to_string(),
                        detail: format!("`{key}` must be a positive number, got {v}"),
                    });
                }
                Slot::OptionalInt(None) | Slot::Float(_) | Slot::Bool(_) => {}
            }
        }
        match self {
            ModelConfig::Mlp(_) => Ok(()),
            ModelConfig::Gpt(c) => {
                divisible(model, ("hidden", c.hidden), ("heads", c.n_heads))?;
                c.moe.as_ref().map_or(Ok(()), |moe| check_moe(model, moe))
            }
            ModelConfig::Llama(c) => {
                // A head dim of its own frees the hidden size from the heads.
                if c.head_dim.is_none() {
                    divisible(model, ("hidden", c.hidden), ("heads", c.n_heads))?;
                }
                divisible(model, ("heads", c.n_heads), ("kv_heads", c.n_kv_heads))?;
                if c.head_dim() % 2 != 0 {
                    let which = match c.head_dim {
                        Some(_) => "`head_dim`",
                        None => "`hidden`/`heads`",
                    };
                    return Err(FrontendError::InvalidConfig {
                        model: model.to_string(),
                        detail: format!(
                            "the head dim {which} = {} must be even for rotary embeddings",
                            c.head_dim()
                        ),
                    });
                }
                c.moe.as_ref().map_or(Ok(()), |moe| check_moe(model, moe))
            }
        }
    }
}

/// Prints the canonical spec, which [`crate::zoo::resolve`] reads back to an equal config.
impl fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (family, style) = self.family();
        write!(f, "{family}:")?;
        let mut settings: Vec<String> = style.map(|s| format!("style={s}")).into_iter().collect();
        for (key, slot) in self.clone().slots() {
            let value = match slot {
                Slot::Int(v) | Slot::OptionalInt(Some(v)) => v.to_string(),
                Slot::OptionalInt(None) => continue,
                Slot::Float(v) => v.to_string(),
                Slot::Bool(v) => v.to_string(),
            };
            settings.push(format!("{key}={value}"));
        }
        f.write_str(&settings.join(","))
    }
}

/// Parses a model argument: a preset name, a preset with overrides, or a generic spec.
pub(crate) fn parse(arg: &str) -> Result<Model, FrontendError> {
    let arg = arg.trim();
    let (head, body) = arg.split_once(':').unwrap_or((arg, ""));
    let settings = settings(arg, body)?;
    let config = match presets::find(head.trim()) {
        Some(preset) => {
            let mut config = preset.config.clone();
            apply(&mut config, arg, &settings, &[])?;
            config
        }
        None => family_config(head.trim(), arg, &settings)?,
    };
    config.validate(arg)?;
    Ok(Model {
        name: arg.to_string(),
        config,
    })
}

/// The `key=value` pairs of a spec body, in order; empty pieces are skipped.
fn settings<'a>(model: &str, body: &'a str) -> Result<Vec<(&'a str, &'a str)>, FrontendError> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    for piece in body.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let malformed = || FrontendError::MalformedSetting {
            model: model.to_string(),
            setting: piece.to_string(),
        };
        let (key, value) = piece.split_once('=').ok_or_else(malformed)?;
        let (key, value) = (key.trim(), value.trim());
        if key.is_empty() || value.is_empty() {
            return Err(malformed());
        }
        if out.iter().any(|&(seen, _)| seen == key) {
            return Err(FrontendError::DuplicateKey {
                model: model.to_string(),
                key: key.to_string(),
            });
        }
        out.push((key, value));
    }
    Ok(out)
}

/// A generic spec's config: the family's defaults, then the settings, then the checks that
/// every required key was given.
fn family_config(
    family: &str,
    model: &str,
    settings: &[(&str, &str)],
) -> Result<ModelConfig, FrontendError> {
    let given = |key: &str| settings.iter().any(|&(k, _)| k == key);
    let gpt = |moe| {
        ModelConfig::Gpt(GptConfig {
            n_layers: 0,
            hidden: 0,
            n_heads: 0,
            seq_len: 0,
            vocab: 0,
            ffn: None,
            moe,
        })
    };
    let llama = |moe| {
        ModelConfig::Llama(LlamaConfig {
            n_layers: 0,
            hidden: 0,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim: None,
            ffn: 0,
            seq_len: 0,
            vocab: 0,
            rope_base: 10000.0,
            moe,
        })
    };
    let (mut config, required, extra_keys): (ModelConfig, &[&str], &[&'static str]) = match family {
        "gpt" => (gpt(None), GPT_REQUIRED, &[]),
        "llama" => (llama(None), LLAMA_REQUIRED, &[]),
        "mlp" => (
            ModelConfig::Mlp(MlpConfig {
                n_in: 0,
                hidden: 0,
                n_out: 0,
            }),
            MLP_REQUIRED,
            &[],
        ),
        "moe" => {
            let moe = Some(MoeConfig::with_defaults());
            match settings.iter().find(|&&(k, _)| k == "style") {
                None | Some((_, "gpt")) => (gpt(moe), MOE_GPT_REQUIRED, &["style"]),
                Some((_, "llama")) => (llama(moe), MOE_LLAMA_REQUIRED, &["style"]),
                Some(&(key, value)) => {
                    return Err(FrontendError::BadValue {
                        model: model.to_string(),
                        key: key.to_string(),
                        value: value.to_string(),
                        expected: "`gpt` or `llama`",
                    });
                }
            }
        }
        _ => {
            let known: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
            let families: Vec<&str> = FAMILIES
                .iter()
                .filter_map(|(usage, _)| usage.split_once(':').map(|(f, _)| f))
                .collect();
            return Err(FrontendError::UnknownModel {
                name: family.to_string(),
                known: known.join(", "),
                families: families.join(", "),
            });
        }
    };
    apply(&mut config, model, settings, extra_keys)?;
    if let Some(key) = required.iter().find(|k| !given(k)) {
        return Err(FrontendError::MissingKey {
            model: model.to_string(),
            key: key.to_string(),
            required: required.join(", "),
        });
    }
    if let ModelConfig::Llama(c) = &mut config
        && !given("kv_heads")
    {
        c.n_kv_heads = c.n_heads;
    }
    Ok(config)
}

/// Writes `settings` into `config`. `extra_keys` are valid but handled by the caller.
fn apply(
    config: &mut ModelConfig,
    model: &str,
    settings: &[(&str, &str)],
    extra_keys: &[&'static str],
) -> Result<(), FrontendError> {
    let mut valid = config.keys();
    valid.extend_from_slice(extra_keys);
    let mut slots = config.slots();
    for &(key, value) in settings {
        if extra_keys.contains(&key) {
            continue;
        }
        let Some((_, slot)) = slots.iter_mut().find(|(k, _)| *k == key) else {
            return Err(FrontendError::UnknownKey {
                model: model.to_string(),
                key: key.to_string(),
                valid: valid.join(", "),
            });
        };
        let bad = |expected| FrontendError::BadValue {
            model: model.to_string(),
            key: key.to_string(),
            value: value.to_string(),
            expected,
        };
        match slot {
            Slot::Int(v) => **v = value.parse().map_err(|_| bad("an integer"))?,
            Slot::OptionalInt(v) => **v = Some(value.parse().map_err(|_| bad("an integer"))?),
            Slot::Float(v) => **v = value.parse().map_err(|_| bad("a number"))?,
            Slot::Bool(v) => {
                **v = match value {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => return Err(bad("`true` or `false`")),
                }
            }
        }
    }
    Ok(())
}

/// A size (or the batch) must be in `1..=MAX_SIZE`.
pub(crate) fn check_size(
    model: &str,
    key: &'static str,
    value: usize,
) -> Result<(), FrontendError> {
    if value == 0 {
        return Err(FrontendError::ZeroValue {
            model: model.to_string(),
            key,
        });
    }
    if value > MAX_SIZE {
        return Err(FrontendError::TooLarge {
            model: model.to_string(),
            key,
            value,
            max: MAX_SIZE,
        });
    }
    Ok(())
}

fn divisible(
    model: &str,
    (key, value): (&'static str, usize),
    (by_key, by): (&'static str, usize),
) -> Result<(), FrontendError> {
    if value % by == 0 {
        Ok(())
    } else {
        Err(FrontendError::NotDivisible {
            model: model.to_string(),
            key,
            value,
            by_key,
            by,
        })
    }
}

fn check_moe(model: &str, moe: &MoeConfig) -> Result<(), FrontendError> {
    if moe.top_k > moe.n_experts {
        return Err(FrontendError::TopKExceedsExperts {
            model: model.to_string(),
            top_k: moe.top_k,
            experts: moe.n_experts,
        });
    }
    Ok(())
}
