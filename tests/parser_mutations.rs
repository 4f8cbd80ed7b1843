//! The bounded counterpart of the `fuzz/` targets for `.air` text, JSON graphs, plans and
//! cluster TOML, run by `cargo test`: each parser is fed thousands of deterministic
//! mutations of valid inputs (bytes flipped, ranges cut or repeated, truncations, and tokens
//! that break parsers: huge and negative numbers, brackets, quotes, separators) and must
//! answer `Ok` or `Err` without panicking; whatever it accepts must satisfy the same
//! round-trip property as its fuzz target (one definition, `fuzz/properties.rs`, serves
//! both). `cargo fuzz` explores further (see `fuzz/README.md`); this keeps every target's
//! property under test in CI, for a bounded time. `AUTOPAR_PROPERTY_SEED=N` (decimal) mixes
//! `N` into every salt to draw other mutations.

use autopar_cost_model::{Cluster, Plan};
use autopar_ir::json::to_json;
use autopar_ir::text::parse;

#[path = "../fuzz/properties.rs"]
mod properties;

/// Mutations per seed input.
const MUTATIONS: usize = 3000;

/// Tokens that stress parsers.
const TOKENS: &[&str] = &[
    "0",
    "-1",
    "18446744073709551615",
    "99999999999999999999999",
    "1e308",
    "-0",
    "nan",
    "inf",
    ",",
    "=",
    ":",
    "[",
    "]",
    "{",
    "}",
    "\"",
    "%",
    "\n",
    "dp=",
    "tp=0",
    "f32[",
    "nodes=",
];

/// A deterministic generator (a linear congruential one).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

/// One to three random edits of `seed`.
fn mutate(rng: &mut Lcg, seed: &str) -> String {
    let mut b = seed.as_bytes().to_vec();
    for _ in 0..1 + rng.below(3) {
        let len = b.len();
        let at = rng.below(len + 1);
        match rng.below(6) {
            0 if len > 0 => {
                let i = rng.below(len);
                b[i] = b[i].wrapping_add(1 + rng.below(255) as u8);
            }
            1 if len > 0 => {
                let end = (at + 1 + rng.below(16)).min(len);
                b.drain(at.min(end)..end);
            }
            2 if len > 0 => {
                let end = (at + 1 + rng.below(32)).min(len);
                let piece = b[at.min(end)..end].to_vec();
                b.splice(at..at, piece);
            }
            3 => b.truncate(at),
            _ => {
                let t = TOKENS[rng.below(TOKENS.len())].as_bytes();
                b.splice(at..at, t.iter().copied());
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// Every mutation of every seed through `check`, which says whether the parser accepted the
/// input. Every seed must be accepted, and some mutations accepted and some refused: a
/// mutator that only ever broke (or never broke) its inputs would test nothing.
fn each_mutation(seeds: &[String], salt: u64, mut check: impl FnMut(&str) -> bool) {
    let swept = std::env::var("AUTOPAR_PROPERTY_SEED").map_or(0, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("AUTOPAR_PROPERTY_SEED={v} is not a decimal number"))
    });
    let mut rng = Lcg(salt ^ swept);
    let (mut accepted, mut refused) = (0, 0);
    for seed in seeds {
        assert!(check(seed), "a seed is refused: {seed}");
        for _ in 0..MUTATIONS {
            if check(&mutate(&mut rng, seed)) {
                accepted += 1;
            } else {
                refused += 1;
            }
        }
    }
    assert!(
        accepted > 0 && refused > 0,
        "{accepted} mutations accepted, {refused} refused"
    );
}

fn air_seeds() -> Vec<String> {
    let seed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/seeds/gpt_tiny.air"
    ))
    .expect("the fuzz seed");
    vec![seed]
}

#[test]
fn air_text_mutations_parse_or_fail_cleanly() {
    each_mutation(&air_seeds(), 1, properties::air);
}

#[test]
fn json_graph_mutations_load_or_fail_cleanly() {
    let seeds: Vec<String> = air_seeds()
        .iter()
        .map(|s| to_json(&parse(s).expect("the seed parses")))
        .collect();
    each_mutation(&seeds, 2, properties::json_graph);
}

#[test]
fn plan_mutations_parse_or_fail_cleanly() {
    let texts = [
        "dp=8,tp=8,pp=16,vpp=2,mbs=1,recompute=full,gbs=1536",
        "dp=2,tp=2,mbs=4,zero=3",
        "dp=64,tp=8,pp=8,mbs=1,recompute=selective,schedule=interleaved,vpp=4,gbs=1024",
    ];
    let mut seeds: Vec<String> = texts.iter().map(|s| s.to_string()).collect();
    for t in texts {
        let p = Plan::parse(t).expect("a seed plan");
        seeds.push(serde_json::to_string(&p).expect("a plan serialises"));
    }
    each_mutation(&seeds, 3, properties::plan);
}

#[test]
fn cluster_mutations_parse_or_fail_cleanly() {
    let specs = ["dgx-h100:nodes=2", "dgx-a100:nodes=4", "dgx-b200"];
    let mut seeds: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
    for s in specs {
        seeds.push(Cluster::preset(s).expect("a preset").to_toml());
    }
    each_mutation(&seeds, 4, properties::cluster);
}
