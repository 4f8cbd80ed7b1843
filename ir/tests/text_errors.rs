//! Parse errors: each names the line and column of the problem and says what was expected
//! or what is wrong.

#![allow(clippy::unwrap_used)]

use autopar_ir::text::{MAX_LIST_LEN, ParseError, parse};

/// A two-parameter prefix (lines 1–3) that the cases below extend.
const HEAD: &str = "graph \"g\" {\n  %0: f32[2,3] = parameter {name=\"a\", init=zeros}\n  %1: f32[3,2] = parameter {name=\"b\", init=zeros}\n";

fn err(src: &str) -> ParseError {
    match parse(src) {
        Ok(g) => panic!("parsed without error:\n{src}\n{g:?}"),
        Err(e) => e,
    }
}

/// Asserts the error of `HEAD + body + "}"` (so line 4 is the first line of `body`).
#[track_caller]
fn assert_err(body: &str, line: usize, col: usize, message: &str) {
    let src = format!("{HEAD}{body}}}\n");
    let e = err(&src);
    assert_eq!(
        (e.line, e.col, e.message.as_str()),
        (line, col, message),
        "\n{src}"
    );
}

#[test]
fn display_and_error_trait() {
    let e = err("graph \"g\" {\n  output \"x\" %5\n}");
    assert_eq!(e.to_string(), "line 2, column 14: expected `=`, found `%5`");
    let boxed: Box<dyn std::error::Error> = Box::new(e);
    assert!(boxed.to_string().starts_with("line 2"));
}

#[test]
fn malformed_line() {
    assert_err(
        "  %2: f32[2,3] exp %0\n",
        4,
        16,
        "expected `,`, `=` or a sharding (`user{...}` or `inferred{...}`), found `exp`",
    );
    assert_err(
        "  %2: f32[2,3 = exp %0\n",
        4,
        15,
        "expected `,` or `]`, found `=`",
    );
    assert_err(
        "  %2 f32[2,3] = exp %0\n",
        4,
        6,
        "expected `:`, found `f32`",
    );
    assert_err(
        "  %2: = exp %0\n",
        4,
        7,
        "expected a dtype like `f32`, found `=`",
    );
    assert_err(
        "  %2: f32[2,3] = exp %0,\n",
        5,
        1,
        "expected a value like `%3`, found `}`",
    );
    assert_err(
        "  %2: f32[2,3] = 42\n",
        4,
        18,
        "expected an op mnemonic, found `42`",
    );
    assert_err("  @\n", 4, 3, "unexpected character `@`");
    assert_err(
        "  %2: f32[2,3] = exp %0 scope=\"unterminated\n",
        4,
        31,
        "unterminated string (strings end on their line)",
    );
    let e = err("");
    assert_eq!((e.line, e.col), (1, 1));
    assert_eq!(e.message, "expected `graph`, found end of input");
    let e = err("graph \"g\" {\n}\n}");
    assert_eq!((e.line, e.col), (3, 1));
    assert_eq!(
        e.message,
        "expected end of input after the graph's closing `}`, found `}`"
    );
    let e = err("graph \"g\" {\n  %0: f32[] = constant {value=1.0}\n");
    assert_eq!((e.line, e.col), (3, 1));
    assert_eq!(
        e.message,
        "expected a node, an `output` line or `}`, found end of input"
    );
}

#[test]
fn undefined_and_twice_defined_values() {
    assert_err(
        "  %2: f32[2,3] = exp %5\n",
        4,
        22,
        "%5 is not defined (a value must be defined before it is used)",
    );
    assert_err(
        "  %2: f32[2,3] = exp %2\n",
        4,
        22,
        "%2 is not defined (a value must be defined before it is used)",
    );
    assert_err(
        "  %1: f32[2,3] = exp %0\n",
        4,
        3,
        "%1 is defined twice (first on line 3)",
    );
    assert_err(
        "  %2: f32[2,3], %2: f32[2,3] = exp %0\n",
        4,
        17,
        "%2 is defined twice (first on line 4)",
    );
    assert_err("  output \"o\" = %9\n", 4, 16, "%9 is not defined");
    assert_err(
        "  %2000000: f32[2,3] = exp %0\n",
        4,
        3,
        "value number %2000000 is too large (the maximum is %1048575)",
    );
    assert_err(
        "  %99999999999: f32[] = exp %0\n",
        4,
        3,
        "value number `%99999999999` is too large",
    );
}

#[test]
fn shape_mismatch_names_op_and_shapes() {
    assert_err(
        "  %2: f32[2,3] = add %0, %1\n",
        4,
        3,
        "`add`: operand types differ: f32[2,3] vs f32[3,2]",
    );
    assert_err(
        "  %2: f32[2,2] = einsum %0, %0 {spec=\"ab,bc->ac\"}\n",
        4,
        3,
        "`einsum`: `ab,bc->ac`: label `b` is 3 in lhs f32[2,3] but 2 in rhs f32[2,3]",
    );
    // Source ops without a declared result, and result-count mismatches, come from the op too.
    assert_err("  exp %0\n", 4, 3, "`exp`: has 1 results, but 0 were named");
    assert_err(
        "  %2: f32[2,3], %3: f32[2,3] = exp %0\n",
        4,
        3,
        "`exp`: has 1 results, but 2 were named",
    );
    assert_err(
        "  %2: f32[2] = send %0 {axis=\"pp\", shift=1}\n",
        4,
        3,
        "`send` over mesh axes needs a device mesh, and the graph has none",
    );
}

#[test]
fn wrong_declared_type() {
    assert_err(
        "  %2: f32[3,2] = exp %0\n",
        4,
        7,
        "%2 is declared as f32[3,2], but `exp` gives f32[2,3]",
    );
    assert_err(
        "  %2: bool[2,3] = exp %0\n",
        4,
        7,
        "%2 is declared as bool[2,3], but `exp` gives f32[2,3]",
    );
}

#[test]
fn attribute_errors() {
    assert_err(
        "  %2: f32[2,3] = softmax %0 {dim=1, axis=0}\n",
        4,
        37,
        "unknown attribute `axis` for `softmax` (expected `dim`)",
    );
    assert_err(
        "  %2: f32[2,3] = exp %0 {dim=1}\n",
        4,
        26,
        "unknown attribute `dim` for `exp` (it takes none)",
    );
    assert_err(
        "  %2: f32[2,3] = softmax %0 {dim=1, dim=1}\n",
        4,
        37,
        "attribute `dim` is given twice",
    );
    assert_err(
        "  %2: f32[2,3] = slice %0 {dim=1, end=2}\n",
        4,
        18,
        "`slice` is missing attribute `start`",
    );
    assert_err(
        "  %2: f32[2,3] = softmax %0\n",
        4,
        18,
        "`softmax` is missing attribute `dim`",
    );
    assert_err(
        "  %2: f32[2,3] = frobnicate %0\n",
        4,
        18,
        "unknown op `frobnicate`",
    );
    assert_err(
        "  %2: f64[2,3] = cast %0 {to=f64}\n",
        4,
        7,
        "unknown dtype `f64` (expected one of f32, f16, bf16, i32, i64, bool)",
    );
    assert_err(
        "  %2: f32[4] = parameter {name=\"c\", init=uniform(1.0)}\n",
        4,
        42,
        "unknown initialiser `uniform` (expected `normal(std)`, `zeros`, `ones` or `values(\"...\")`)",
    );
    assert_err(
        "  %2: f32[2,2] = einsum %0, %1 {spec=\"ab,b2->a\"}\n",
        4,
        38,
        "einsum spec `ab,b2->a`: label `2` is not an ASCII letter",
    );
    assert_err(
        "  %2: f32[2,3] = softmax %0 {dim=-1}\n",
        4,
        34,
        "expected an unsigned integer, found `-`",
    );
    assert_err(
        "  %2: f32[2,3] = softmax %0 {dim=1.5}\n",
        4,
        34,
        "expected an unsigned integer, found `1.5`",
    );
    assert_err(
        "  %2: f32[2,3] = attention %0, %0, %0 {causal=yes, scale=1.0}\n",
        4,
        47,
        "expected `true` or `false`, found `yes`",
    );
    assert_err(
        "  %2: f32[] = constant {value=1e999}\n",
        4,
        31,
        "float `1e999` is out of range",
    );
    assert_err(
        "  %2: f32[] = constant {value=-NaN}\n",
        4,
        32,
        "expected a number, found `NaN`",
    );
    assert_err(
        "  %2: f32[] = constant {value=NaN(0x1)}\n",
        4,
        35,
        "`0x1` is not the bits of a NaN",
    );
    assert_err(
        "  %2: f32[] = constant {value=1.5 }\n  %3: i32[] = constant {value=1.5}\n",
        5,
        3,
        "`constant`: invalid attribute `value`: 1.5 is not an integer",
    );
    assert_err(
        "  %2: f32[2] = recv {axis=\"pp\", shift=99999999999999999999}\n",
        4,
        39,
        "integer `99999999999999999999` does not fit in 64 bits",
    );
}

#[test]
fn integer_overflow_in_dims_is_an_error() {
    assert_err(
        "  %2: f32[99999999999999999999] = parameter {name=\"c\", init=zeros}\n",
        4,
        11,
        "integer `99999999999999999999` is too large (the maximum is 18446744073709551615)",
    );
    // Dims that fit but whose product would not are refused where the value is declared,
    // and so is a result that grows past the bound (an all-gather of the largest tensor).
    let max = usize::MAX;
    let src = format!(
        "graph \"g\" {{\n  mesh dp=2\n  %0: f32[{max}] = parameter {{name=\"a\", init=zeros}}\n}}"
    );
    let e = err(&src);
    assert_eq!((e.line, e.col), (3, 3));
    assert!(
        e.message.contains("more than the 2^52 elements"),
        "{}",
        e.message
    );
    let top = 1u64 << 52;
    let src = format!(
        "graph \"g\" {{\n  mesh dp=2\n  %0: f32[{top}] = parameter {{name=\"a\", init=zeros}}\n  %1: f32[{}] = all_gather %0 {{axes=[\"dp\"], dim=0}}\n}}",
        2 * top
    );
    let e = err(&src);
    assert_eq!((e.line, e.col), (4, 3));
    assert!(
        e.message
            .contains("`all_gather`: gives f32[9007199254740992]"),
        "{}",
        e.message
    );
    let src = format!(
        "graph \"g\" {{\n  %0: f32[{top}] = parameter {{name=\"a\", init=zeros}}\n  %1: f32[{}] = concat %0, %0 {{dim=0}}\n}}",
        2 * top
    );
    let e = err(&src);
    assert_eq!((e.line, e.col), (3, 3));
    assert!(e.message.contains("`concat`: gives"), "{}", e.message);
    // Splitting and joining the same dim does not grow it, even at the largest size.
    let src = format!(
        "graph \"g\" {{\n  mesh dp=4\n  %0: f32[{top}] = parameter {{name=\"a\", init=zeros}}\n  %1: f32[{top}] = all_to_all %0 {{axes=[\"dp\"], split_dim=0, concat_dim=0}}\n}}\n"
    );
    assert_eq!(autopar_ir::text::print(&parse(&src).unwrap()), src);
}

#[test]
fn sharding_errors() {
    assert_err(
        "  %2: f32[2,3] user{dp: S(2)} = exp %0\n",
        4,
        16,
        "sharding of %2 (f32[2,3]): mesh axis `dp` shards dim 2, but the value has rank 2",
    );
    assert_err(
        "  %2: f32[2,3] user{dp: R, dp: S(0)} = exp %0\n",
        4,
        16,
        "sharding of %2 (f32[2,3]): mesh axis `dp` is listed twice",
    );
    assert_err(
        "  %2: f32[2,3] user{dp: Q} = exp %0\n",
        4,
        25,
        "expected a placement (`R`, `S(dim)` or `P(sum|max|min)`), found `Q`",
    );
    assert_err(
        "  %2: f32[2,3] user{dp: P(avg)} = exp %0\n",
        4,
        27,
        "unknown reduction `avg` (expected `sum`, `max` or `min`)",
    );
    let src = "graph \"g\" {\n  mesh dp=4\n  %0: f32[6] inferred{dp: S(0)} = parameter {name=\"a\", init=zeros}\n}";
    let e = err(src);
    assert_eq!((e.line, e.col), (3, 14));
    assert_eq!(
        e.message,
        "sharding of %0 (f32[6]): dim 0 (size 6) does not split evenly over mesh axis `dp` (4 ways in all)"
    );
}

#[test]
fn structure_errors() {
    assert_err(
        "  mesh dp=2\n",
        4,
        3,
        "the `mesh` line must come first, before any node",
    );
    assert_err(
        "  output \"o\" = %0\n  %2: f32[2,3] = exp %0\n",
        5,
        3,
        "nodes must come before the `output` lines",
    );
    assert_err(
        "  output \"o\" = %0\n  output \"o\" = %1\n",
        5,
        10,
        "verifier: output `o` is defined twice",
    );
    assert_err(
        "  %2: f32[2] = parameter {name=\"a\", init=ones}\n",
        4,
        3,
        "parameter `a` is defined twice (first on line 2)",
    );
    let e = err("graph \"g\" {\n  mesh dp=0\n}");
    assert_eq!(
        (e.line, e.col, e.message.as_str()),
        (2, 3, "invalid device mesh: mesh axis `dp` has size 0")
    );
    let e = err("graph \"g\" {\n  mesh dp=2, tp=2 devices=[0,1,2]\n}");
    assert_eq!(
        (e.line, e.col, e.message.as_str()),
        (
            2,
            3,
            "invalid device mesh: mesh has 4 coordinates but the device map lists 3 devices"
        )
    );
    let e = err("graph \"g\" {\n  mesh dp=1024, tp=1024, pp=2\n}");
    assert_eq!(
        (e.line, e.col, e.message.as_str()),
        (2, 26, "the mesh has more than 1048576 devices")
    );
    let e = err("graph \"g\" {\n  mesh dp=18446744073709551615, tp=18446744073709551615\n}");
    assert_eq!((e.line, e.col), (2, 8));
}

#[test]
fn messages_stay_short_whatever_the_input() {
    let long = "x".repeat(10_000);
    let e = err(&format!("{HEAD}  %2: f32[] = {long} %0\n}}"));
    assert_eq!(e.message, format!("unknown op `{}...`", "x".repeat(40)));
    let e = err(&format!("{HEAD}  %2: f32[] = exp %0 \"{long}\"\n}}"));
    assert!(e.message.len() < 200, "{}", e.message);
    let digits = "9".repeat(10_000);
    assert!(
        err(&format!("{HEAD}  %2: f32[{digits}] = exp %0\n}}"))
            .message
            .len()
            < 200
    );
}

#[test]
fn list_lengths_are_bounded() {
    let dims = vec!["1"; MAX_LIST_LEN + 1].join(",");
    let src =
        format!("graph \"g\" {{\n  %0: f32[{dims}] = parameter {{name=\"a\", init=zeros}}\n}}");
    let e = err(&src);
    assert_eq!(e.line, 2);
    assert_eq!(
        e.message,
        format!("a list may have at most {MAX_LIST_LEN} items")
    );
    let axes: Vec<String> = (0..=MAX_LIST_LEN).map(|i| format!("a{i}=1")).collect();
    let src = format!("graph \"g\" {{\n  mesh {}\n}}", axes.join(", "));
    assert_eq!(
        err(&src).message,
        format!("a mesh may have at most {MAX_LIST_LEN} axes")
    );
    // Just under the limit is fine.
    let dims = vec!["1"; MAX_LIST_LEN].join(",");
    let src =
        format!("graph \"g\" {{\n  %0: f32[{dims}] = parameter {{name=\"a\", init=zeros}}\n}}");
    assert!(parse(&src).is_ok());
}
