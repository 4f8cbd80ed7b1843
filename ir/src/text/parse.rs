//! The parser: recursive descent over the lexer's tokens, building the graph through
//! [`Graph::add_node_with_ids`] so that every node is type-checked as it is read.

use std::collections::HashMap;

use super::lexer::{Lexer, Pos, TokKind, Token, shorten};
use super::schema::{attr_names, prototypes};
use super::{MAX_DEVICES, MAX_LIST_LEN, MAX_VALUE_NUMBER, ParseError};
use crate::graph::{Graph, ValueId};
use crate::infer::infer;
use crate::mesh::{DeviceMesh, MeshAxis};
use crate::meta::NodeMeta;
use crate::op::{EinsumSpec, FusedInstr, FusionBody, Init, InputRole, Op};
use crate::placement::{Placement, ReduceKind, Sharding, ShardingOrigin};
use crate::types::{DType, Shape, TensorType};
use crate::verify::{check_sharding, verify};

/// Parses a graph from the text format. See the [module docs](super) for the syntax and the
/// checks made.
pub fn parse(src: &str) -> Result<Graph, ParseError> {
    Parser::new(src)?.graph()
}

/// One declared result of a node: `%3: f32[8] user{dp: S(0)}`.
struct Declared {
    id: ValueId,
    ty: TensorType,
    ty_pos: Pos,
    sharding: Option<(Sharding, Pos)>,
}

struct Parser<'a> {
    lex: Lexer<'a>,
    /// The lookahead token.
    tok: Token,
    /// One op per mnemonic, cloned for each node and filled in from its attributes.
    protos: Vec<Op>,
    /// Where each value was defined.
    defs: HashMap<u32, Pos>,
    /// Where each parameter and each input name was first used.
    param_names: HashMap<String, Pos>,
    input_names: HashMap<String, Pos>,
    /// The operand types of the fusion whose attributes are being read (its body's
    /// parameters).
    fusion_params: Vec<TensorType>,
}

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Result<Self, ParseError> {
        let mut lex = Lexer::new(src);
        let tok = lex.next_token()?;
        Ok(Parser {
            lex,
            tok,
            protos: prototypes(),
            defs: HashMap::new(),
            param_names: HashMap::new(),
            input_names: HashMap::new(),
            fusion_params: Vec::new(),
        })
    }

    // ---- token helpers ------------------------------------------------------------------

    /// Consumes the lookahead token and returns it.
    fn advance(&mut self) -> Result<Token, ParseError> {
        let next = self.lex.next_token()?;
        Ok(std::mem::replace(&mut self.tok, next))
    }

    /// An "expected X, found Y" error at the lookahead token.
    fn expected(&self, what: &str) -> ParseError {
        self.tok
            .pos
            .error(format!("expected {what}, found {}", self.tok.kind))
    }

    /// Consumes the lookahead if it is the punctuation `kind`.
    fn eat(&mut self, kind: &TokKind) -> Result<bool, ParseError> {
        if self.tok.kind == *kind {
            self.advance()?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Consumes the punctuation `kind`, or fails naming it.
    fn expect(&mut self, kind: &TokKind) -> Result<Pos, ParseError> {
        if self.tok.kind == *kind {
            Ok(self.advance()?.pos)
        } else {
            Err(self.expected(&kind.to_string()))
        }
    }

    /// True when the lookahead is the identifier `word`.
    fn at_word(&self, word: &str) -> bool {
        matches!(&self.tok.kind, TokKind::Ident(s) if s == word)
    }

    /// Consumes the keyword `word`, or fails naming it.
    fn expect_word(&mut self, word: &str) -> Result<Pos, ParseError> {
        if self.at_word(word) {
            Ok(self.advance()?.pos)
        } else {
            Err(self.expected(&format!("`{word}`")))
        }
    }

    /// An identifier, described as `what` if missing.
    fn ident(&mut self, what: &str) -> Result<(String, Pos), ParseError> {
        if let TokKind::Ident(_) = self.tok.kind {
            let t = self.advance()?;
            if let TokKind::Ident(s) = t.kind {
                return Ok((s, t.pos));
            }
        }
        Err(self.expected(what))
    }

    /// A string literal, described as `what` if missing.
    fn string(&mut self, what: &str) -> Result<(String, Pos), ParseError> {
        if let TokKind::Str(_) = self.tok.kind {
            let t = self.advance()?;
            if let TokKind::Str(s) = t.kind {
                return Ok((s, t.pos));
            }
        }
        Err(self.expected(what))
    }

    /// A value reference `%N`.
    fn value(&mut self) -> Result<(ValueId, Pos), ParseError> {
        if let TokKind::Value(n) = self.tok.kind {
            let pos = self.advance()?.pos;
            return Ok((ValueId(n), pos));
        }
        Err(self.expected("a value like `%3`"))
    }

    /// A fusion body value `^N`.
    fn body_value(&mut self) -> Result<(usize, Pos), ParseError> {
        if let TokKind::BodyValue(n) = self.tok.kind {
            let pos = self.advance()?.pos;
            return Ok((n as usize, pos));
        }
        Err(self.expected("a body value like `^2`"))
    }

    /// `{^K: type = op ^a, ^b {attrs}; ...; yield ^r, ...}`: the body of a fusion whose
    /// operands have the types `self.fusion_params`; every instruction is type-checked as it
    /// is read.
    fn fusion_body(&mut self) -> Result<FusionBody, ParseError> {
        let params = std::mem::take(&mut self.fusion_params);
        self.expect(&TokKind::LBrace)?;
        let mut types = params.clone();
        let mut instrs = Vec::new();
        let defined = |v: usize, pos: Pos, types: &[TensorType]| {
            if v < types.len() {
                Ok(v)
            } else {
                Err(pos.error(format!("^{v} is not defined in the body before it is used")))
            }
        };
        loop {
            if self.at_word("yield") {
                self.advance()?;
                let mut results = Vec::new();
                loop {
                    let (v, pos) = self.body_value()?;
                    results.push(defined(v, pos, &types)?);
                    if !self.eat(&TokKind::Comma)? {
                        break;
                    }
                }
                self.expect(&TokKind::RBrace)?;
                return Ok(FusionBody {
                    params,
                    instrs,
                    results,
                });
            }
            let start = self.tok.pos;
            let (id, id_pos) = self.body_value()?;
            if id != types.len() {
                return Err(id_pos.error(format!(
                    "expected ^{}: body values are numbered in order, after the {} operands",
                    types.len(),
                    params.len()
                )));
            }
            self.expect(&TokKind::Colon)?;
            let ty_pos = self.tok.pos;
            let ty = self.tensor_type()?;
            self.expect(&TokKind::Eq)?;
            let (mnemonic, op_pos) = self.ident("an op mnemonic")?;
            let Some(mut op) = self.protos.iter().find(|p| p.name() == mnemonic).cloned() else {
                return Err(op_pos.error(format!("unknown op `{}`", shorten(&mnemonic))));
            };
            if !FusionBody::admits(&op) {
                return Err(op_pos.error(format!("`{mnemonic}` cannot be part of a fusion body")));
            }
            let mut operands = Vec::new();
            if let TokKind::BodyValue(_) = self.tok.kind {
                loop {
                    let (v, pos) = self.body_value()?;
                    operands.push(defined(v, pos, &types)?);
                    if !self.eat(&TokKind::Comma)? {
                        break;
                    }
                }
            }
            let mut seen: Vec<&'static str> = Vec::new();
            if self.tok.kind == TokKind::LBrace {
                self.attrs(&mut op, &mut seen)?;
            }
            if let Some(missing) = attr_names(&op).iter().find(|a| !seen.contains(a)) {
                return Err(op_pos.error(format!("`{mnemonic}` is missing attribute `{missing}`")));
            }
            if let Some(t) = op.source_type_mut() {
                *t = ty.clone();
            }
            let tys: Vec<&TensorType> = operands.iter().map(|&v| &types[v]).collect();
            check_dim_arithmetic(&op, &tys, None).map_err(|m| start.error(m))?;
            let out = infer(&op, &tys, None).map_err(|e| start.error(e.to_string()))?;
            if out.first() != Some(&ty) || out.len() != 1 {
                return Err(ty_pos.error(format!(
                    "^{id} is declared as {ty}, but `{mnemonic}` gives {}",
                    out.first().map_or("nothing".to_string(), |t| t.to_string())
                )));
            }
            types.push(ty);
            instrs.push(FusedInstr { op, operands });
            self.expect(&TokKind::Semicolon)?;
        }
    }

    /// A non-negative decimal integer.
    fn usize(&mut self) -> Result<usize, ParseError> {
        let TokKind::Number(s) = &self.tok.kind else {
            return Err(self.expected("an unsigned integer"));
        };
        if !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(self.expected("an unsigned integer"));
        }
        let n = s.parse::<usize>().map_err(|_| {
            self.tok.pos.error(format!(
                "integer `{}` is too large (the maximum is {})",
                shorten(s),
                usize::MAX
            ))
        })?;
        self.advance()?;
        Ok(n)
    }

    /// A signed decimal integer.
    fn i64(&mut self) -> Result<i64, ParseError> {
        let start = self.tok.pos;
        let neg = self.eat(&TokKind::Minus)?;
        let TokKind::Number(s) = &self.tok.kind else {
            return Err(self.expected("an integer"));
        };
        if !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(self.expected("an integer"));
        }
        let text = if neg { format!("-{s}") } else { s.clone() };
        let n = text.parse::<i64>().map_err(|_| {
            start.error(format!(
                "integer `{}` does not fit in 64 bits",
                shorten(&text)
            ))
        })?;
        self.advance()?;
        Ok(n)
    }

    /// A float: a decimal literal, `inf`, `-inf`, `NaN` or `NaN(0x...)` (the bits of a
    /// non-canonical NaN).
    fn f64(&mut self) -> Result<f64, ParseError> {
        let start = self.tok.pos;
        let neg = self.eat(&TokKind::Minus)?;
        let sign = if neg { -1.0 } else { 1.0 };
        match &self.tok.kind {
            TokKind::Number(s) if !s.starts_with("0x") => {
                let text = if neg { format!("-{s}") } else { s.clone() };
                let x = text
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| {
                        start.error(format!("float `{}` is out of range", shorten(&text)))
                    })?;
                self.advance()?;
                Ok(x)
            }
            TokKind::Ident(s) if s == "inf" => {
                self.advance()?;
                Ok(sign * f64::INFINITY)
            }
            TokKind::Ident(s) if s == "NaN" && !neg => {
                self.advance()?;
                if !self.eat(&TokKind::LParen)? {
                    return Ok(f64::NAN);
                }
                let bits_pos = self.tok.pos;
                let x = match &self.tok.kind {
                    TokKind::Number(s) if s.starts_with("0x") => u64::from_str_radix(&s[2..], 16)
                        .ok()
                        .map(f64::from_bits)
                        .filter(|x| x.is_nan())
                        .ok_or_else(|| {
                            bits_pos.error(format!("`{}` is not the bits of a NaN", shorten(s)))
                        })?,
                    _ => return Err(self.expected("the bits of a NaN, like `0x7ff8000000000001`")),
                };
                self.advance()?;
                self.expect(&TokKind::RParen)?;
                Ok(x)
            }
            _ => Err(self.expected("a number")),
        }
    }

    /// `true` or `false`.
    fn bool(&mut self) -> Result<bool, ParseError> {
        let b = match &self.tok.kind {
            TokKind::Ident(s) if s == "true" => true,
            TokKind::Ident(s) if s == "false" => false,
            _ => return Err(self.expected("`true` or `false`")),
        };
        self.advance()?;
        Ok(b)
    }

    /// `[item, item, ...]` with at most [`MAX_LIST_LEN`] items.
    fn list<T>(
        &mut self,
        mut item: impl FnMut(&mut Self) -> Result<T, ParseError>,
    ) -> Result<Vec<T>, ParseError> {
        self.expect(&TokKind::LBracket)?;
        let mut out = Vec::new();
        if self.eat(&TokKind::RBracket)? {
            return Ok(out);
        }
        loop {
            if out.len() == MAX_LIST_LEN {
                return Err(self
                    .tok
                    .pos
                    .error(format!("a list may have at most {MAX_LIST_LEN} items")));
            }
            out.push(item(self)?);
            if self.eat(&TokKind::Comma)? {
                continue;
            }
            if self.eat(&TokKind::RBracket)? {
                return Ok(out);
            }
            return Err(self.expected("`,` or `]`"));
        }
    }

    fn usize_list(&mut self) -> Result<Vec<usize>, ParseError> {
        self.list(Self::usize)
    }

    fn string_list(&mut self) -> Result<Vec<String>, ParseError> {
        self.list(|p| Ok(p.string("a string")?.0))
    }

    /// A dtype name.
    fn dtype(&mut self) -> Result<DType, ParseError> {
        let (name, pos) = self.ident("a dtype like `f32`")?;
        DType::from_name(&name).ok_or_else(|| {
            let all: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
            pos.error(format!(
                "unknown dtype `{}` (expected one of {})",
                shorten(&name),
                all.join(", ")
            ))
        })
    }

    /// `f32[8,32]`.
    fn tensor_type(&mut self) -> Result<TensorType, ParseError> {
        let dtype = self.dtype()?;
        let dims = self.usize_list()?;
        Ok(TensorType::new(dtype, dims))
    }

    /// A reduction kind: `sum`, `max` or `min`.
    fn reduce_kind(&mut self) -> Result<ReduceKind, ParseError> {
        let (name, pos) = self.ident("`sum`, `max` or `min`")?;
        ReduceKind::from_name(&name).ok_or_else(|| {
            pos.error(format!(
                "unknown reduction `{}` (expected `sum`, `max` or `min`)",
                shorten(&name)
            ))
        })
    }

    /// `normal(0.02)`, `zeros` or `ones`.
    /// `{phase=backward, mb=1, layer=block(3), part=attention, role=query}`, fields in any
    /// order, each once.
    fn meta(&mut self) -> Result<NodeMeta, ParseError> {
        self.expect(&TokKind::LBrace)?;
        let mut meta = NodeMeta::default();
        let mut seen: Vec<String> = Vec::new();
        if self.eat(&TokKind::RBrace)? {
            return Ok(meta);
        }
        loop {
            let (key, key_pos) =
                self.ident("a metadata field (`phase`, `mb`, `layer`, `part`, `role`)")?;
            if seen.contains(&key) {
                return Err(key_pos.error(format!("metadata field `{key}` is repeated")));
            }
            self.expect(&TokKind::Eq)?;
            match key.as_str() {
                "phase" => {
                    let (word, pos) = self.ident("a phase")?;
                    meta.phase = Some(word.parse().map_err(|e: String| pos.error(e))?);
                }
                "mb" => {
                    let pos = self.tok.pos;
                    let k = self.usize()?;
                    meta.micro_batch = Some(u32::try_from(k).map_err(|_| {
                        pos.error(format!("micro-batch {k} does not fit in 32 bits"))
                    })?);
                }
                "layer" => {
                    let (word, pos) = self.ident("a layer")?;
                    let text = if word == "block" {
                        self.expect(&TokKind::LParen)?;
                        let i = self.usize()?;
                        self.expect(&TokKind::RParen)?;
                        format!("block({i})")
                    } else {
                        word
                    };
                    meta.layer = Some(text.parse().map_err(|e: String| pos.error(e))?);
                }
                "part" => {
                    let (word, pos) = self.ident("a part")?;
                    meta.part = Some(word.parse().map_err(|e: String| pos.error(e))?);
                }
                "role" => {
                    let (word, pos) = self.ident("a weight role")?;
                    meta.role = Some(word.parse().map_err(|e: String| pos.error(e))?);
                }
                _ => {
                    return Err(key_pos.error(format!(
                        "unknown metadata field `{}` (expected `phase`, `mb`, `layer`, `part` or \
                         `role`)",
                        shorten(&key)
                    )));
                }
            }
            seen.push(key);
            if self.eat(&TokKind::Comma)? {
                continue;
            }
            self.expect(&TokKind::RBrace)?;
            return Ok(meta);
        }
    }

    fn init(&mut self) -> Result<Init, ParseError> {
        let (name, pos) = self.ident("an initialiser")?;
        match name.as_str() {
            "normal" => {
                self.expect(&TokKind::LParen)?;
                let std = self.f64()?;
                self.expect(&TokKind::RParen)?;
                Ok(Init::Normal { std })
            }
            "zeros" => Ok(Init::Zeros),
            "ones" => Ok(Init::Ones),
            _ => Err(pos.error(format!(
                "unknown initialiser `{}` (expected `normal(std)`, `zeros` or `ones`)",
                shorten(&name)
            ))),
        }
    }

    /// `tokens(256)`, `next_tokens(256)`, `features` or `regression_targets`.
    fn role(&mut self) -> Result<InputRole, ParseError> {
        let (name, pos) = self.ident("an input role")?;
        let vocab = |p: &mut Self| -> Result<usize, ParseError> {
            p.expect(&TokKind::LParen)?;
            let v = p.usize()?;
            p.expect(&TokKind::RParen)?;
            Ok(v)
        };
        match name.as_str() {
            "tokens" => Ok(InputRole::Tokens {
                vocab: vocab(self)?,
            }),
            "next_tokens" => Ok(InputRole::NextTokens {
                vocab: vocab(self)?,
            }),
            "features" => Ok(InputRole::Features),
            "regression_targets" => Ok(InputRole::RegressionTargets),
            _ => Err(pos.error(format!(
                "unknown input role `{}` (expected `tokens(vocab)`, `next_tokens(vocab)`, \
                 `features` or `regression_targets`)",
                shorten(&name)
            ))),
        }
    }

    /// An einsum spec, written as a string.
    fn einsum_spec(&mut self) -> Result<EinsumSpec, ParseError> {
        let (s, pos) = self.string("an einsum spec like \"bsh,hf->bsf\"")?;
        s.parse::<EinsumSpec>().map_err(|e| pos.error(e))
    }

    /// `user{dp: S(0), tp: R}` or `inferred{...}`.
    fn sharding(&mut self) -> Result<Sharding, ParseError> {
        let (word, pos) = self.ident("`user` or `inferred`")?;
        let origin = match word.as_str() {
            "user" => ShardingOrigin::User,
            "inferred" => ShardingOrigin::Inferred,
            _ => {
                return Err(pos.error(format!(
                    "expected `user` or `inferred`, found `{}`",
                    shorten(&word)
                )));
            }
        };
        self.expect(&TokKind::LBrace)?;
        let mut axes = Vec::new();
        if !self.eat(&TokKind::RBrace)? {
            loop {
                if axes.len() == MAX_LIST_LEN {
                    return Err(self.tok.pos.error(format!(
                        "a sharding may list at most {MAX_LIST_LEN} mesh axes"
                    )));
                }
                let axis = match &self.tok.kind {
                    TokKind::Ident(_) => self.ident("a mesh axis")?.0,
                    TokKind::Str(_) => self.string("a mesh axis")?.0,
                    _ => return Err(self.expected("a mesh axis name")),
                };
                self.expect(&TokKind::Colon)?;
                axes.push((axis, self.placement()?));
                if self.eat(&TokKind::Comma)? {
                    continue;
                }
                if self.eat(&TokKind::RBrace)? {
                    break;
                }
                return Err(self.expected("`,` or `}`"));
            }
        }
        Ok(Sharding { axes, origin })
    }

    /// `R`, `S(dim)` or `P(sum|max|min)`.
    fn placement(&mut self) -> Result<Placement, ParseError> {
        const WHAT: &str = "a placement (`R`, `S(dim)` or `P(sum|max|min)`)";
        let p = match &self.tok.kind {
            TokKind::Ident(s) if s == "R" => {
                self.advance()?;
                return Ok(Placement::Replicate);
            }
            TokKind::Ident(s) if s == "S" => {
                self.advance()?;
                self.expect(&TokKind::LParen)?;
                Placement::Shard(self.usize()?)
            }
            TokKind::Ident(s) if s == "P" => {
                self.advance()?;
                self.expect(&TokKind::LParen)?;
                Placement::Partial(self.reduce_kind()?)
            }
            _ => return Err(self.expected(WHAT)),
        };
        self.expect(&TokKind::RParen)?;
        Ok(p)
    }

    // ---- the grammar ----------------------------------------------------------------------

    /// `graph "name" { [mesh] node* output* }`, then the end of input.
    fn graph(mut self) -> Result<Graph, ParseError> {
        self.expect_word("graph")?;
        let (name, _) = self.string("the graph name (a string)")?;
        self.expect(&TokKind::LBrace)?;
        let mut g = Graph::new(name);
        if self.at_word("mesh") {
            self.mesh(&mut g)?;
        }
        let mut seen_output = false;
        loop {
            match &self.tok.kind {
                TokKind::RBrace => break,
                TokKind::Ident(s) if s == "output" => {
                    self.output(&mut g)?;
                    seen_output = true;
                }
                TokKind::Ident(s) if s == "mesh" => {
                    return Err(self
                        .tok
                        .pos
                        .error("the `mesh` line must come first, before any node"));
                }
                TokKind::Value(_) | TokKind::Ident(_) if seen_output => {
                    return Err(self
                        .tok
                        .pos
                        .error("nodes must come before the `output` lines"));
                }
                TokKind::Value(_) | TokKind::Ident(_) => self.node(&mut g)?,
                _ => return Err(self.expected("a node, an `output` line or `}`")),
            }
        }
        let close = self.advance()?.pos;
        if self.tok.kind != TokKind::Eof {
            return Err(self.expected("end of input after the graph's closing `}`"));
        }
        verify(&g).map_err(|e| close.error(e.to_string()))?;
        Ok(g)
    }

    /// `mesh dp=2, tp=4 [devices=[...]]`.
    fn mesh(&mut self, g: &mut Graph) -> Result<(), ParseError> {
        let pos = self.expect_word("mesh")?;
        let mut axes = Vec::new();
        let mut n_devices: usize = 1;
        loop {
            let (name, axis_pos) = self.ident("a mesh axis name")?;
            if axes.len() == MAX_LIST_LEN {
                return Err(axis_pos.error(format!("a mesh may have at most {MAX_LIST_LEN} axes")));
            }
            self.expect(&TokKind::Eq)?;
            let size = self.usize()?;
            n_devices = n_devices
                .checked_mul(size)
                .filter(|&n| n <= MAX_DEVICES)
                .ok_or_else(|| {
                    axis_pos.error(format!("the mesh has more than {MAX_DEVICES} devices"))
                })?;
            axes.push(MeshAxis { name, size });
            if !self.eat(&TokKind::Comma)? {
                break;
            }
        }
        let devices = if self.at_word("devices") {
            self.advance()?;
            self.expect(&TokKind::Eq)?;
            self.expect(&TokKind::LBracket)?;
            let mut devices = Vec::new();
            if !self.eat(&TokKind::RBracket)? {
                loop {
                    if devices.len() == MAX_DEVICES {
                        return Err(self.tok.pos.error(format!(
                            "a device map may list at most {MAX_DEVICES} devices"
                        )));
                    }
                    devices.push(self.usize()?);
                    if self.eat(&TokKind::Comma)? {
                        continue;
                    }
                    if self.eat(&TokKind::RBracket)? {
                        break;
                    }
                    return Err(self.expected("`,` or `]`"));
                }
            }
            devices
        } else {
            (0..n_devices).collect()
        };
        let mesh = DeviceMesh::with_devices(axes, devices).map_err(|e| pos.error(e.to_string()))?;
        g.set_mesh(Some(mesh));
        Ok(())
    }

    /// `output "name" = %N`.
    fn output(&mut self, g: &mut Graph) -> Result<(), ParseError> {
        self.expect_word("output")?;
        let (name, name_pos) = self.string("the output name (a string)")?;
        self.expect(&TokKind::Eq)?;
        let (v, v_pos) = self.value()?;
        if g.value_checked(v).is_err() {
            return Err(v_pos.error(format!("{v} is not defined")));
        }
        g.add_output(name, v)
            .map_err(|e| name_pos.error(e.to_string()))
    }

    /// `%a: T [sharding], ... = mnemonic %x, %y {attrs} [scope="..."]`, or the same without
    /// the results part for ops that have none.
    fn node(&mut self, g: &mut Graph) -> Result<(), ParseError> {
        let start = self.tok.pos;
        let mut results: Vec<Declared> = Vec::new();
        if let TokKind::Value(_) = self.tok.kind {
            loop {
                let (id, id_pos) = self.value()?;
                if id.0 > MAX_VALUE_NUMBER {
                    return Err(id_pos.error(format!(
                        "value number {id} is too large (the maximum is %{MAX_VALUE_NUMBER})"
                    )));
                }
                if let Some(first) = self.defs.get(&id.0) {
                    return Err(id_pos.error(format!(
                        "{id} is defined twice (first on line {})",
                        first.line
                    )));
                }
                self.defs.insert(id.0, id_pos);
                self.expect(&TokKind::Colon)?;
                let ty_pos = self.tok.pos;
                let ty = self.tensor_type()?;
                let sharding = if self.at_word("user") || self.at_word("inferred") {
                    let pos = self.tok.pos;
                    Some((self.sharding()?, pos))
                } else {
                    None
                };
                results.push(Declared {
                    id,
                    ty,
                    ty_pos,
                    sharding,
                });
                if self.eat(&TokKind::Comma)? {
                    continue;
                }
                if self.eat(&TokKind::Eq)? {
                    break;
                }
                return Err(
                    self.expected("`,`, `=` or a sharding (`user{...}` or `inferred{...}`)")
                );
            }
        }

        let (mnemonic, op_pos) = self.ident("an op mnemonic")?;
        let Some(mut op) = self.protos.iter().find(|p| p.name() == mnemonic).cloned() else {
            return Err(op_pos.error(format!("unknown op `{}`", shorten(&mnemonic))));
        };

        let mut operands = Vec::new();
        if let TokKind::Value(_) = self.tok.kind {
            loop {
                let (v, v_pos) = self.value()?;
                if g.value_checked(v).is_err() {
                    return Err(v_pos.error(format!(
                        "{v} is not defined (a value must be defined before it is used)"
                    )));
                }
                operands.push(v);
                if !self.eat(&TokKind::Comma)? {
                    break;
                }
            }
        }

        let mut seen: Vec<&'static str> = Vec::new();
        if let Op::Fusion { .. } = op {
            self.fusion_params = operands
                .iter()
                .filter_map(|&v| g.value_checked(v).ok().map(|x| x.ty.clone()))
                .collect();
        }
        if self.tok.kind == TokKind::LBrace {
            self.attrs(&mut op, &mut seen)?;
        }
        if let Some(missing) = attr_names(&op).iter().find(|a| !seen.contains(a)) {
            return Err(op_pos.error(format!("`{mnemonic}` is missing attribute `{missing}`")));
        }

        let scope = if self.at_word("scope") {
            self.advance()?;
            self.expect(&TokKind::Eq)?;
            Some(self.string("the scope (a string)")?.0)
        } else {
            None
        };
        let meta = if self.at_word("meta") {
            self.advance()?;
            self.meta()?
        } else {
            NodeMeta::default()
        };

        if let (Some(ty), Some(first)) = (op.source_type_mut(), results.first()) {
            *ty = first.ty.clone();
        }
        self.check_unique_name(&op, start)?;
        {
            let mut tys = Vec::with_capacity(operands.len());
            for &v in &operands {
                tys.push(
                    &g.value_checked(v)
                        .map_err(|e| start.error(e.to_string()))?
                        .ty,
                );
            }
            check_dim_arithmetic(&op, &tys, g.mesh()).map_err(|m| start.error(m))?;
        }

        let ids: Vec<ValueId> = results.iter().map(|r| r.id).collect();
        let name = op.name();
        let n = g
            .add_node_with_ids(op, &operands, &ids, scope)
            .map_err(|e| start.error(e.to_string()))?;
        g.set_meta(n, meta);
        for r in results {
            let actual = &g
                .value_checked(r.id)
                .map_err(|e| start.error(e.to_string()))?
                .ty;
            if *actual != r.ty {
                return Err(r.ty_pos.error(format!(
                    "{} is declared as {}, but `{name}` gives {actual}",
                    r.id, r.ty
                )));
            }
            if let Some((s, pos)) = r.sharding {
                check_sharding(g, r.id, &r.ty, &s).map_err(|e| pos.error(e.to_string()))?;
                g.set_sharding(r.id, Some(s))
                    .map_err(|e| pos.error(e.to_string()))?;
            }
        }
        Ok(())
    }

    /// Parameter names are unique, and so are input names (the verifier checks this too,
    /// but here the error can point at the node).
    fn check_unique_name(&mut self, op: &Op, pos: Pos) -> Result<(), ParseError> {
        let (names, name, what) = if let Op::Parameter { name, .. } = op {
            (&mut self.param_names, name, "parameter")
        } else if let Op::Input { name, .. } = op {
            (&mut self.input_names, name, "input")
        } else {
            return Ok(());
        };
        if let Some(first) = names.get(name) {
            return Err(pos.error(format!(
                "{what} `{name}` is defined twice (first on line {})",
                first.line
            )));
        }
        names.insert(name.clone(), pos);
        Ok(())
    }

    /// `{k=v, ...}`: fills in the attributes of `op`, recording each name in `seen`.
    fn attrs(&mut self, op: &mut Op, seen: &mut Vec<&'static str>) -> Result<(), ParseError> {
        self.expect(&TokKind::LBrace)?;
        if self.eat(&TokKind::RBrace)? {
            return Ok(());
        }
        loop {
            let (key, key_pos) = self.ident("an attribute name")?;
            let names = attr_names(op);
            let Some(&name) = names.iter().find(|n| **n == key) else {
                let expected = if names.is_empty() {
                    "it takes none".to_string()
                } else {
                    let list: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
                    format!("expected {}", list.join(", "))
                };
                return Err(key_pos.error(format!(
                    "unknown attribute `{}` for `{}` ({expected})",
                    shorten(&key),
                    op.name()
                )));
            };
            if seen.contains(&name) {
                return Err(key_pos.error(format!("attribute `{name}` is given twice")));
            }
            seen.push(name);
            self.expect(&TokKind::Eq)?;
            if !self.attr_value(op, name)? {
                return Err(key_pos.error(format!(
                    "attribute `{name}` of `{}` has no reader (a bug in the text format)",
                    op.name()
                )));
            }
            if self.eat(&TokKind::Comma)? {
                continue;
            }
            if self.eat(&TokKind::RBrace)? {
                return Ok(());
            }
            return Err(self.expected("`,` or `}`"));
        }
    }

    /// Reads the value of attribute `key` into `op`; false if `op` has no such field.
    fn attr_value(&mut self, op: &mut Op, key: &str) -> Result<bool, ParseError> {
        let p = self;
        match op {
            Op::Parameter { name, ty: _, init } => match key {
                "name" => *name = p.string("a string")?.0,
                "init" => *init = p.init()?,
                _ => return Ok(false),
            },
            Op::Input { name, ty: _, role } => match key {
                "name" => *name = p.string("a string")?.0,
                "role" => *role = p.role()?,
                _ => return Ok(false),
            },
            Op::Constant { ty: _, value } => match key {
                "value" => *value = p.f64()?,
                _ => return Ok(false),
            },
            Op::Einsum { spec } => match key {
                "spec" => *spec = p.einsum_spec()?,
                _ => return Ok(false),
            },
            Op::Unary { func: _ }
            | Op::Binary { func: _ }
            | Op::Compare { func: _ }
            | Op::Select
            | Op::Gather
            | Op::CrossEntropy => return Ok(false),
            Op::Cast { to } => match key {
                "to" => *to = p.dtype()?,
                _ => return Ok(false),
            },
            Op::Reduce { func: _, dims } => match key {
                "dims" => *dims = p.usize_list()?,
                _ => return Ok(false),
            },
            Op::Softmax { dim } | Op::Concat { dim } => match key {
                "dim" => *dim = p.usize()?,
                _ => return Ok(false),
            },
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => match key {
                "eps" => *eps = p.f64()?,
                _ => return Ok(false),
            },
            Op::ScatterAdd { num_rows } => match key {
                "num_rows" => *num_rows = p.usize()?,
                _ => return Ok(false),
            },
            Op::Reshape { shape } => match key {
                "shape" => *shape = Shape(p.usize_list()?),
                _ => return Ok(false),
            },
            Op::Transpose { perm } => match key {
                "perm" => *perm = p.usize_list()?,
                _ => return Ok(false),
            },
            Op::Slice { dim, start, end } => match key {
                "dim" => *dim = p.usize()?,
                "start" => *start = p.usize()?,
                "end" => *end = p.usize()?,
                _ => return Ok(false),
            },
            Op::Broadcast { shape, dims } => match key {
                "shape" => *shape = Shape(p.usize_list()?),
                "dims" => *dims = p.usize_list()?,
                _ => return Ok(false),
            },
            Op::Rotary { base } => match key {
                "base" => *base = p.f64()?,
                _ => return Ok(false),
            },
            Op::Attention { causal, scale } | Op::AttentionBackward { causal, scale } => {
                match key {
                    "causal" => *causal = p.bool()?,
                    "scale" => *scale = p.f64()?,
                    _ => return Ok(false),
                }
            }
            Op::MoeRoute {
                top_k,
                capacity,
                normalize,
            } => match key {
                "top_k" => *top_k = p.usize()?,
                "capacity" => *capacity = p.usize()?,
                "normalize" => *normalize = p.bool()?,
                _ => return Ok(false),
            },
            Op::SgdUpdate {
                lr,
                momentum,
                weight_decay,
            } => match key {
                "lr" => *lr = p.f64()?,
                "momentum" => *momentum = p.f64()?,
                "weight_decay" => *weight_decay = p.f64()?,
                _ => return Ok(false),
            },
            Op::AdamWUpdate {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => match key {
                "lr" => *lr = p.f64()?,
                "beta1" => *beta1 = p.f64()?,
                "beta2" => *beta2 = p.f64()?,
                "eps" => *eps = p.f64()?,
                "weight_decay" => *weight_decay = p.f64()?,
                _ => return Ok(false),
            },
            Op::AllReduce { axes, reduce } => match key {
                "axes" => *axes = p.string_list()?,
                "reduce" => *reduce = p.reduce_kind()?,
                _ => return Ok(false),
            },
            Op::AllGather { axes, dim } => match key {
                "axes" => *axes = p.string_list()?,
                "dim" => *dim = p.usize()?,
                _ => return Ok(false),
            },
            Op::ReduceScatter { axes, dim, reduce } => match key {
                "axes" => *axes = p.string_list()?,
                "dim" => *dim = p.usize()?,
                "reduce" => *reduce = p.reduce_kind()?,
                _ => return Ok(false),
            },
            Op::AllToAll {
                axes,
                split_dim,
                concat_dim,
            } => match key {
                "axes" => *axes = p.string_list()?,
                "split_dim" => *split_dim = p.usize()?,
                "concat_dim" => *concat_dim = p.usize()?,
                _ => return Ok(false),
            },
            Op::CollectiveBroadcast { axes, root } => match key {
                "axes" => *axes = p.string_list()?,
                "root" => *root = p.usize()?,
                _ => return Ok(false),
            },
            Op::Send { axis, shift } | Op::Recv { axis, shift, ty: _ } => match key {
                "axis" => *axis = p.string("a string")?.0,
                "shift" => *shift = p.i64()?,
                _ => return Ok(false),
            },
            Op::Fusion { body } => match key {
                "body" => *body = p.fusion_body()?,
                _ => return Ok(false),
            },
        }
        Ok(true)
    }
}

/// Rejects ops whose result dims would overflow `usize` (shape inference multiplies and adds
/// dims without checking), so that no input can make it panic.
fn check_dim_arithmetic(
    op: &Op,
    tys: &[&TensorType],
    mesh: Option<&DeviceMesh>,
) -> Result<(), String> {
    // The group size, when every axis is in the mesh and the product fits (otherwise shape
    // inference reports the problem itself).
    let group = |axes: &[String]| -> Option<usize> {
        let mesh = mesh?;
        axes.iter()
            .try_fold(1usize, |acc, a| acc.checked_mul(mesh.axis_size(a)?))
    };
    let dim_of = |t: &TensorType, d: usize| t.dims().get(d).copied();
    let overflow = |what: String| Err(format!("`{}`: {what} overflows", op.name()));
    match op {
        Op::Concat { dim } => {
            let mut total: usize = 0;
            for t in tys {
                let Some(d) = dim_of(t, *dim) else {
                    return Ok(());
                };
                match total.checked_add(d) {
                    Some(s) => total = s,
                    None => return overflow(format!("the total size of dim {dim}")),
                }
            }
            Ok(())
        }
        // All-to-all divides `split_dim` before multiplying `concat_dim`, so when they are
        // the same dim nothing grows.
        Op::AllToAll {
            split_dim,
            concat_dim,
            ..
        } if split_dim == concat_dim => Ok(()),
        Op::AllGather { axes, dim: d }
        | Op::AllToAll {
            axes,
            concat_dim: d,
            split_dim: _,
        } => {
            let (Some(t), Some(n)) = (tys.first(), group(axes)) else {
                return Ok(());
            };
            match dim_of(t, *d) {
                Some(size) if size.checked_mul(n).is_none() => {
                    overflow(format!("dim {d} of {t} times the group size {n}"))
                }
                _ => Ok(()),
            }
        }
        Op::Parameter { .. }
        | Op::Input { .. }
        | Op::Constant { .. }
        | Op::Einsum { .. }
        | Op::Unary { .. }
        | Op::Binary { .. }
        | Op::Compare { .. }
        | Op::Select
        | Op::Cast { .. }
        | Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::Gather
        | Op::ScatterAdd { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Broadcast { .. }
        | Op::Rotary { .. }
        | Op::Attention { .. }
        | Op::AttentionBackward { .. }
        | Op::MoeRoute { .. }
        | Op::CrossEntropy
        | Op::SgdUpdate { .. }
        | Op::AdamWUpdate { .. }
        | Op::AllReduce { .. }
        | Op::ReduceScatter { .. }
        | Op::CollectiveBroadcast { .. }
        | Op::Send { .. }
        | Op::Recv { .. }
        | Op::Fusion { .. } => Ok(()),
    }
}
