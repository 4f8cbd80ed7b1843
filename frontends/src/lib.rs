//! Model frontends for autopar: a Rust model-building API with semi-automatic sharding
//! annotations, the model zoo written with it, and the import of ONNX files ([`onnx`]).
//!
//! Model code talks to a [`ModelBuilder`] and to copyable [`Tensor`] handles. Operators and
//! methods add IR ops; [`ModelBuilder::scope`] records where in the model each op comes from;
//! [`Tensor::shard`] and [`Tensor::replicate`] write the placements that the compiler must
//! respect and propagates from. Mistakes do not panic: the first one is kept, with its scope,
//! and returned by [`ModelBuilder::finish`].
//!
//! ```
//! use autopar_frontends::{DType, InputRole, ModelBuilder, ZEROS, normal};
//!
//! let (b, h, f) = (8, 32, 128);
//! let m = ModelBuilder::new("two-layer");
//! let x = m.input("features", DType::F32, [b, h], InputRole::Features);
//! let y = m.input("targets", DType::F32, [b, h], InputRole::RegressionTargets);
//! let out = m.scope("mlp", || {
//!     let w1 = m.param("w1", [h, f], normal(0.02)).shard(1, "tp");
//!     let b1 = m.param("b1", [f], ZEROS).shard(0, "tp");
//!     let w2 = m.param("w2", [f, h], normal(0.02)).shard(0, "tp");
//!     x.einsum("bh,hf->bf", w1).add_bias(b1).gelu().einsum("bf,fh->bh", w2)
//! });
//! m.output("loss", (out - y).square().mean([0, 1]));
//! let graph = m.finish()?;
//! assert_eq!(graph.parameters()[0].1, "mlp.w1");
//! # Ok::<(), autopar_frontends::FrontendError>(())
//! ```

pub mod builder;
pub mod error;
pub mod onnx;
pub mod tensor;
pub mod zoo;

pub use autopar_ir::{DType, Init, InputRole, Placement};
pub use builder::{ModelBuilder, ONES, ZEROS, normal};
pub use error::FrontendError;
pub use tensor::{MoeRouting, Tensor};
