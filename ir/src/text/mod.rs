//! The text format of graphs (`.air` files): a printer and a parser that round-trip exactly.
//!
//! [`print()`] writes a [`Graph`](crate::Graph) in one canonical layout; [`parse`] reads any
//! spacing of the same tokens back, type-checking every node as it goes, and reports the
//! first problem as a [`ParseError`] with its line and column. For any graph `g` that passes
//! [`verify`](crate::verify()), `parse(&print(&g))` equals `g` (value numbers included), and
//! printing a parsed file reproduces it byte for byte when the file was itself printed.
//!
//! # Example
//!
//! ```
//! use autopar_ir::text::{parse, print};
//!
//! let src = r#"graph "gpt-tiny" {
//!   mesh dp=2, pp=2, tp=2
//!   %0: i32[8,32] = input {name="tokens", role=tokens(256)}
//!   %1: f32[256,64] user{tp: S(0)} = parameter {name="wte", init=normal(0.02)} meta{role=token_embedding}
//!   %2: f32[8,32,64] = gather %1, %0 scope="embed" meta{phase=forward, layer=embedding}
//!   %3: f32[8,32,64] inferred{dp: S(0), tp: R} = gelu %2
//!   %4: f32[64,4] = parameter {name="router", init=zeros}
//!   %5: f32[8,32,4] = einsum %3, %4 {spec="bsh,he->bse"}
//!   %6: f32[256,4] = reshape %5 {shape=[256,4]}
//!   %7: f32[256,4] = softmax %6 {dim=1}
//!   %8: f32[256,4,128], %9: f32[256,4,128] = moe_route %7 {top_k=2, capacity=128, normalize=true}
//!   send %3 {axis="pp", shift=1}
//!   %12: f32[8,32] = reduce_sum %3 {dims=[2]}
//!   output "combine" = %8
//!   output "pooled" = %12
//! }
//! "#;
//! let g = parse(src)?;
//! assert_eq!(g.num_nodes(), 11);
//! assert_eq!(print(&g), src);
//! # Ok::<(), autopar_ir::text::ParseError>(())
//! ```
//!
//! # Syntax
//!
//! A file is one graph:
//!
//! ```text
//! graph "<name>" {
//!   mesh <axis>=<size>, ...  [devices=[<id>, ...]]
//!   <node>
//!   ...
//!   output "<name>" = %<N>
//!   ...
//! }
//! ```
//!
//! - `#` starts a comment that runs to the end of the line, anywhere outside a string.
//! - The `mesh` line is optional and comes first. `devices=[...]` is printed only when the
//!   device map is not the identity (`mesh dp=2, tp=2 devices=[0,2,1,3]`). A mesh with no
//!   axes is not printed, so it reads back as no mesh.
//! - A node is `results = mnemonic operands {attributes} scope="..." meta{...}`, printed one per line
//!   in [`Graph::topo_order`](crate::Graph::topo_order) order:
//!   - results: `%N: <type> [<sharding>]`, separated by `, `. An op without results
//!     (`send`) has no `... =` part. Value numbers are kept as written, so the ids of a
//!     graph with holes (after `remove_node`) survive the round trip.
//!   - type: `f32[8,32,64]`, a scalar `f32[]`; dtypes `f32 f16 bf16 i32 i64 bool`.
//!   - sharding: `user{dp: S(0), tp: R}` for a user annotation, `inferred{...}` for one a
//!     pass derived; placements `R`, `S(dim)`, `P(sum)`, `P(max)`, `P(min)`; an empty
//!     sharding is `user{}`. Axis names that are not identifiers are written as strings.
//!   - mnemonic: [`Op::name`](crate::Op::name). Unary, binary, comparison and reduction
//!     functions are part of it (`gelu`, `add`, `lt`, `reduce_sum`).
//!   - operands: `%a, %b`, each defined on an earlier line.
//!   - attributes: `{k=v, ...}` named as the op variant's fields and printed in their
//!     order; omitted when the op has none. Source ops (`parameter`, `input`, `constant`,
//!     `recv`) take their `ty` from the declared result type instead of an attribute. The
//!     parser accepts attributes in any order.
//!   - `scope="h.0.attn"`: the node's scope, when it has one: human-readable provenance
//!     that no pass reads structure from.
//!   - `meta{phase=backward, mb=1, layer=block(3), part=attention, role=query}`: the node's
//!     typed metadata
//!     ([`crate::meta`]), when it has any; the printer writes the set fields in that order,
//!     the parser accepts them in any order, each at most once. `phase` is one of `forward`,
//!     `saved`, `backward`, `recompute`, `accumulate`, `optimizer`; `mb` the micro-batch
//!     index; `layer` one of `embedding`, `block(N)`, `final_norm`, `head`, `loss`; `part`
//!     one of `norm`, `attention`, `mlp`; `role`
//!     (parameters only) one of `token_embedding`, `position_embedding`, `norm`, `query`,
//!     `key`, `value`, `attention_out`, `mlp_in`, `mlp_gate`, `mlp_out`, `router`,
//!     `expert_in`, `expert_gate`, `expert_out`, `head`, `dense`.
//! - `output` lines come after all nodes.
//! - The parser accepts any whitespace, including line breaks, between tokens. The printer
//!   indents by two spaces; separates results, operands, attributes, mesh axes and sharding
//!   entries by `, ` and the items of bracketed lists (`[8,32]`, `["dp","tp"]`) by a bare
//!   `,`; and ends the file with one newline. Comments are not kept.
//!
//! Attribute values:
//!
//! | kind | examples |
//! |------|----------|
//! | unsigned and signed integers | `dim=2`, `shift=-1` |
//! | floats (Rust's `{:?}`: the shortest text that reads back to the same bits) | `eps=1e-5`, `lr=0.1`, `value=-0.0`, `value=inf`, `value=-inf`, `value=NaN` |
//! | booleans | `causal=true` |
//! | strings, with escapes `\"` `\\` `\n` `\t` and `\u{7f}` for other control characters | `name="h.0.\"q\""` |
//! | lists of integers or strings | `perm=[1,0]`, `axes=["dp","tp"]`, `shape=[8,32]` |
//! | dtypes, reductions | `to=bf16`, `reduce=sum` |
//! | einsum specs, as strings | `spec="bsh,hf->bsf"` |
//! | initialisers | `init=normal(0.02)`, `init=zeros`, `init=ones` |
//! | input roles | `role=tokens(256)`, `role=next_tokens(256)`, `role=features`, `role=regression_targets` |
//!
//! A fusion's one attribute is its body, on one line: `body={^2: f32[4,8] = broadcast ^1
//! {shape=[4,8], dims=[1]}; ^3: f32[4,8] = add ^0, ^2; yield ^3}`. Body values are `^N`:
//! `^0..` are the fusion's operands (with their types), and each instruction defines the
//! next number, with its declared type checked as a node's is; `yield` names the results.
//! Only the ops [`FusionBody::admits`](crate::FusionBody::admits) may appear.
//!
//! A NaN other than the canonical [`f64::NAN`] (another sign or payload) has no `{:?}` text
//! of its own, so it is printed with its bits, `NaN(0xfff8000000000000)`, and read back to
//! exactly those bits. Note that a graph holding a NaN attribute is not `==` to its own copy,
//! because [`Op`](crate::Op)'s equality compares floats as IEEE numbers.
//!
//! # Checks
//!
//! Every error names its 1-based line and column (columns count characters). Besides syntax
//! errors (`expected `=`, found `%5``), the parser rejects unknown mnemonics, unknown,
//! missing or repeated attributes, bad attribute values, a value used before its definition
//! or defined twice, integers that do not fit, and duplicate parameter, input or output
//! names. Nodes are added through [`Graph::add_node_with_ids`](crate::Graph::add_node_with_ids),
//! so an op applied to operands of the wrong types is reported at the node's first token
//! with the [`IrError`](crate::IrError) message, which names the op and the shapes; a
//! declared result type that differs from the one the op gives is reported at the declared
//! type, naming both; a sharding that does not fit its value
//! ([`check_sharding`](crate::verify::check_sharding)) is reported at the sharding. Finally
//! the whole graph goes through [`verify`](crate::verify()), whose errors point at the
//! closing `}`.
//!
//! # Limits
//!
//! The parser never panics and its memory use stays proportional to the input, whatever the
//! input. Dims and sizes are plain integers (a type with dims near `usize::MAX` allocates
//! nothing), and ops whose result dims would overflow are rejected. Three limits keep the
//! graph's own tables small: value numbers up to [`MAX_VALUE_NUMBER`] (the graph stores
//! values in a table indexed by number), meshes of at most [`MAX_DEVICES`] devices, and at
//! most [`MAX_LIST_LEN`] items in any bracketed list (dims of a type, attribute lists,
//! mesh axes, sharding entries).
//!
//! # Fuzzing
//!
//! Besides the property tests in `ir/tests/text_props.rs`, the `fuzz/` directory at the
//! repository root holds a cargo-fuzz target that feeds arbitrary bytes to [`parse`] and
//! checks that whatever parses prints and re-parses to the same text. With `cargo-fuzz`
//! installed, run it from `fuzz/` on a stable toolchain with
//! `RUSTC_BOOTSTRAP=1 cargo fuzz run parse_air`.

mod lexer;
mod parse;
mod print;
mod schema;

use std::fmt;

pub use parse::parse;
pub use print::print;

/// Largest value number the parser accepts (`%1048575`).
pub const MAX_VALUE_NUMBER: u32 = (1 << 20) - 1;

/// Most devices a parsed mesh may have.
pub const MAX_DEVICES: usize = 1 << 20;

/// Most items in one bracketed list of a parsed file.
pub const MAX_LIST_LEN: usize = 1024;

/// A problem found while parsing, at a 1-based line and column.
///
/// Displayed as ``line 3, column 14: expected `=`, found `%5` ``.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub col: usize,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}, column {}: {}",
            self.line, self.col, self.message
        )
    }
}

impl std::error::Error for ParseError {}
