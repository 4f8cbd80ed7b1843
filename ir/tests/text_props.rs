//! Property tests of the text format: the parser survives arbitrary input and mutations of
//! valid files (returning `Ok` or `Err`, never panicking), whatever it accepts prints back
//! stably, and random valid graphs round-trip exactly.

#![allow(clippy::unwrap_used)]

mod text_common;

use autopar_ir::text::{parse, print};
use autopar_ir::{
    BinaryOp, DType, DeviceMesh, Graph, Init, Op, Placement, ReduceOp, Sharding, ShardingOrigin,
    TensorType, UnaryOp, ValueId,
};
use proptest::prelude::*;
use proptest::sample::Index;

/// Parses `src`; when it is accepted, its printout must parse to a graph that prints the same.
fn parse_is_total_and_stable(src: &str) {
    if let Ok(g) = parse(src) {
        let text = print(&g);
        let again =
            parse(&text).unwrap_or_else(|e| panic!("{e}\nreprinted:\n{text}\nfrom:\n{src}"));
        assert_eq!(print(&again), text);
    }
}

/// Words the format is made of, to build inputs that get past the lexer.
const VOCAB: &[&str] = &[
    "graph",
    "\"g\"",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    ",",
    ":",
    "=",
    "-",
    "%0",
    "%1",
    "%2",
    "%1048575",
    "%1048576",
    "f32",
    "i32",
    "bool",
    "bf16",
    "2",
    "0",
    "1",
    "18446744073709551615",
    "18446744073709551616",
    "1e-5",
    "0.5",
    "inf",
    "NaN",
    "0x7ff8000000000001",
    "mesh",
    "dp",
    "tp",
    "devices",
    "output",
    "scope",
    "user",
    "inferred",
    "R",
    "S",
    "P",
    "sum",
    "parameter",
    "input",
    "constant",
    "recv",
    "send",
    "gelu",
    "add",
    "einsum",
    "reshape",
    "transpose",
    "reduce_sum",
    "concat",
    "all_gather",
    "all_to_all",
    "moe_route",
    "name",
    "init",
    "normal",
    "zeros",
    "role",
    "tokens",
    "value",
    "spec",
    "\"ab,bc->ac\"",
    "shape",
    "perm",
    "dims",
    "dim",
    "axes",
    "[\"dp\"]",
    "axis",
    "shift",
    "true",
    "\n",
    " ",
    "#c\n",
    "\"\\u{1}\"",
];

/// Splits text into rough tokens (strings, words, single symbols, whitespace runs) for
/// token-level mutations.
fn rough_tokens(s: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        let mut tok = String::from(c);
        if c == '"' {
            while let Some(d) = chars.next() {
                tok.push(d);
                if d == '\\' {
                    if let Some(e) = chars.next() {
                        tok.push(e);
                    }
                } else if d == '"' {
                    break;
                }
            }
        } else if c.is_alphanumeric() || c == '%' || c == '_' || c == '.' {
            while let Some(&d) = chars.peek() {
                if !(d.is_alphanumeric() || d == '_' || d == '.') {
                    break;
                }
                tok.push(d);
                chars.next();
            }
        } else if c.is_whitespace() {
            while let Some(&d) = chars.peek() {
                if !d.is_whitespace() {
                    break;
                }
                tok.push(d);
                chars.next();
            }
        }
        out.push(tok);
    }
    out
}

/// One edit of a text.
#[derive(Clone, Debug)]
enum Mutation {
    DeleteChar(Index),
    InsertChar(Index, char),
    ReplaceChar(Index, char),
    DeleteToken(Index),
    DuplicateToken(Index),
    SwapTokens(Index, Index),
    ReplaceToken(Index, Index),
    InsertWord(Index, Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let ch = prop_oneof![
        any::<char>(),
        prop::sample::select(vec![
            '%', '"', '{', '}', '[', ']', ',', '=', ':', '-', '\\', '\n', '9', 'e', '.', '#'
        ]),
    ];
    prop_oneof![
        any::<Index>().prop_map(Mutation::DeleteChar),
        (any::<Index>(), ch.clone()).prop_map(|(i, c)| Mutation::InsertChar(i, c)),
        (any::<Index>(), ch).prop_map(|(i, c)| Mutation::ReplaceChar(i, c)),
        any::<Index>().prop_map(Mutation::DeleteToken),
        any::<Index>().prop_map(Mutation::DuplicateToken),
        (any::<Index>(), any::<Index>()).prop_map(|(i, j)| Mutation::SwapTokens(i, j)),
        (any::<Index>(), any::<Index>()).prop_map(|(i, j)| Mutation::ReplaceToken(i, j)),
        (any::<Index>(), any::<Index>()).prop_map(|(i, j)| Mutation::InsertWord(i, j)),
    ]
}

fn mutate(text: &str, m: &Mutation) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    let mut toks = rough_tokens(text);
    if chars.is_empty() || toks.is_empty() {
        return text.to_string();
    }
    match m {
        Mutation::DeleteChar(i) => {
            chars.remove(i.index(chars.len()));
        }
        Mutation::InsertChar(i, c) => chars.insert(i.index(chars.len() + 1), *c),
        Mutation::ReplaceChar(i, c) => {
            let i = i.index(chars.len());
            chars[i] = *c;
        }
        Mutation::DeleteToken(i) => {
            toks.remove(i.index(toks.len()));
        }
        Mutation::DuplicateToken(i) => {
            let i = i.index(toks.len());
            toks.insert(i, toks[i].clone());
        }
        Mutation::SwapTokens(i, j) => {
            let (i, j) = (i.index(toks.len()), j.index(toks.len()));
            toks.swap(i, j);
        }
        Mutation::ReplaceToken(i, j) => {
            let (i, j) = (i.index(toks.len()), j.index(toks.len()));
            toks[i] = toks[j].clone();
        }
        Mutation::InsertWord(i, w) => {
            let word = VOCAB[w.index(VOCAB.len())];
            toks.insert(i.index(toks.len() + 1), word.to_string());
        }
    }
    match m {
        Mutation::DeleteChar(_) | Mutation::InsertChar(..) | Mutation::ReplaceChar(..) => {
            chars.into_iter().collect()
        }
        _ => toks.concat(),
    }
}

// ---- random valid graphs ----------------------------------------------------------------

/// One step of a random chain: which op, and two numbers that pick its details.
#[derive(Clone, Debug)]
struct Step {
    op: u8,
    a: u8,
    b: u8,
}

#[derive(Clone, Debug)]
struct Recipe {
    dims: Vec<usize>,
    dtype: DType,
    with_mesh: bool,
    constant_bits: u64,
    steps: Vec<Step>,
}

fn recipe() -> impl Strategy<Value = Recipe> {
    (
        prop::collection::vec(1usize..=4, 0..=3),
        prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        any::<bool>(),
        prop_oneof![any::<u64>(), any::<f64>().prop_map(f64::to_bits)],
        prop::collection::vec(
            (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(op, a, b)| Step { op, a, b }),
            0..12,
        ),
    )
        .prop_map(|(dims, dtype, with_mesh, constant_bits, steps)| Recipe {
            dims,
            dtype,
            with_mesh,
            constant_bits,
            steps,
        })
}

/// Builds a chain of elementwise, einsum, reshape, transpose, reduce and norm ops from a
/// recipe, with shardings, scopes and holes in the value numbering. Returns the graph and
/// whether it holds a NaN (which makes `==` false).
fn build(r: &Recipe) -> (Graph, bool) {
    let mut g = Graph::new("random");
    if r.with_mesh {
        g.set_mesh(Some(DeviceMesh::new([("dp", 2), ("tp", 3)]).unwrap()));
    }
    let mut n_params = 0;
    let mut param = |g: &mut Graph, ty: TensorType| {
        n_params += 1;
        g.add(
            Op::Parameter {
                name: format!("p{n_params}"),
                ty,
                init: Init::Normal { std: 0.02 },
            },
            &[],
        )
        .unwrap()
    };
    let mut cur = param(&mut g, TensorType::new(r.dtype, r.dims.clone()));
    let mut has_nan = false;
    for (i, s) in r.steps.iter().enumerate() {
        let t = g.ty(cur).clone();
        let rank = t.rank();
        let (a, b) = (s.a as usize, s.b as usize);
        let op_choice = if rank == 0 { s.op % 2 } else { s.op % 8 };
        let next = match op_choice {
            0 => g.add(
                Op::Unary {
                    func: UnaryOp::ALL[a % UnaryOp::ALL.len()],
                },
                &[cur],
            ),
            1 => {
                let other = if b % 2 == 0 {
                    cur
                } else {
                    param(&mut g, t.clone())
                };
                g.add(
                    Op::Binary {
                        func: BinaryOp::ALL[a % BinaryOp::ALL.len()],
                    },
                    &[cur, other],
                )
            }
            2 => {
                let k = 1 + b % 4;
                let w = param(&mut g, TensorType::new(t.dtype, [t.dims()[rank - 1], k]));
                let letters: Vec<char> = "abcd".chars().take(rank).collect();
                let mut out = letters[..rank - 1].to_vec();
                out.push('z');
                let spec = autopar_ir::EinsumSpec {
                    lhs: letters.clone(),
                    rhs: vec![letters[rank - 1], 'z'],
                    out,
                };
                g.add(Op::Einsum { spec }, &[cur, w])
            }
            3 => {
                let shape = if a % 2 == 0 {
                    vec![t.dims().iter().product()]
                } else {
                    t.dims().iter().rev().copied().collect()
                };
                g.add(
                    Op::Reshape {
                        shape: shape.into(),
                    },
                    &[cur],
                )
            }
            4 => {
                let perm = (0..rank).map(|d| (d + a) % rank).collect();
                g.add(Op::Transpose { perm }, &[cur])
            }
            5 => {
                let mut dims = vec![a % rank];
                if rank >= 2 && b % 2 == 0 {
                    dims.push((a + 1) % rank);
                    dims.sort_unstable();
                }
                g.add(
                    Op::Reduce {
                        func: ReduceOp::ALL[b % ReduceOp::ALL.len()],
                        dims,
                    },
                    &[cur],
                )
            }
            6 => {
                let h = t.dims()[rank - 1];
                let gamma = param(&mut g, TensorType::new(t.dtype, [h]));
                let eps = b as f64 * 1e-7;
                if a % 2 == 0 {
                    let beta = param(&mut g, TensorType::new(t.dtype, [h]));
                    g.add(Op::LayerNorm { eps }, &[cur, gamma, beta])
                } else {
                    g.add(Op::RmsNorm { eps }, &[cur, gamma])
                }
            }
            _ => {
                let value = f64::from_bits(r.constant_bits.rotate_left(a as u32));
                has_nan |= value.is_nan();
                let c = g
                    .add(
                        Op::Constant {
                            ty: t.clone(),
                            value,
                        },
                        &[],
                    )
                    .unwrap();
                g.add(
                    Op::Binary {
                        func: BinaryOp::Add,
                    },
                    &[cur, c],
                )
            }
        }
        .unwrap();
        let nt = g.ty(next).clone();
        if b % 3 == 0 && nt.rank() >= 1 {
            let p = if nt.dims()[0].is_multiple_of(2) {
                Placement::Shard(0)
            } else {
                Placement::Replicate
            };
            let origin = if a % 2 == 0 {
                ShardingOrigin::User
            } else {
                ShardingOrigin::Inferred
            };
            g.set_sharding(
                next,
                Some(Sharding {
                    axes: vec![("dp".into(), p)],
                    origin,
                }),
            )
            .unwrap();
        }
        if a % 4 == 0 {
            g.set_scope(g.value(next).producer, Some(format!("layer.{i}")));
        }
        if b % 5 == 0 {
            let dead = g.add(Op::Unary { func: UnaryOp::Exp }, &[next]).unwrap();
            g.remove_node(g.value(dead).producer).unwrap();
        }
        cur = next;
    }
    g.add_output("out", cur).unwrap();
    autopar_ir::verify(&g).unwrap();
    (g, has_nan)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        parse_is_total_and_stable(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn random_word_soup_never_panics(
        words in prop::collection::vec(prop::sample::select(VOCAB.to_vec()), 0..64),
        seps in prop::collection::vec(prop::sample::select(vec!["", " ", "\n"]), 64),
    ) {
        let src: String = words.iter().zip(&seps).flat_map(|(w, s)| [*w, *s]).collect();
        parse_is_total_and_stable(&src);
        parse_is_total_and_stable(&format!("graph \"g\" {{\n{src}\n}}"));
        parse_is_total_and_stable(&format!("graph \"g\" {{\n  mesh dp=2\n  %0: f32[4] = parameter {{name=\"p\", init=zeros}}\n  {src}\n}}"));
    }

    #[test]
    fn mutated_every_op_graph_never_panics(muts in prop::collection::vec(mutation(), 1..4)) {
        let mut text = print(&text_common::every_op_graph());
        for m in &muts {
            text = mutate(&text, m);
        }
        parse_is_total_and_stable(&text);
    }

    #[test]
    fn mutated_random_graph_never_panics(r in recipe(), muts in prop::collection::vec(mutation(), 1..4)) {
        let mut text = print(&build(&r).0);
        for m in &muts {
            text = mutate(&text, m);
        }
        parse_is_total_and_stable(&text);
    }

    #[test]
    fn random_graphs_round_trip(r in recipe()) {
        let (g, has_nan) = build(&r);
        let text = print(&g);
        let parsed = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        prop_assert_eq!(print(&parsed), text.clone());
        let ids: Vec<ValueId> = g.value_ids().collect();
        prop_assert_eq!(parsed.value_ids().collect::<Vec<_>>(), ids);
        if !has_nan {
            prop_assert!(parsed == g, "{}", text);
        }
    }
}
