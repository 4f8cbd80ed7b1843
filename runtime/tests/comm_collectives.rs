//! The collectives conformance suite (`conformance/collectives.rs`) over the in-process
//! communicator, through its `Tensor` methods, its shared-memory `f32` methods and the
//! trait's default `f32` methods; the two paths held to the same bits; and the library's
//! group order held to the suite's independent one.

#[path = "conformance/collectives.rs"]
mod collectives;
#[path = "conformance/f32_path.rs"]
mod f32_path;

use autopar_ir::{DType, DeviceMesh, ReduceKind, TensorType};
use autopar_runtime::comm::{Collectives, communicate_f32, group_members};
use autopar_runtime::{CommOptions, Launcher, RuntimeError, Tensor, ThreadLauncher};
use collectives::{TestResult, expected_group, mesh_cases};
use f32_path::F32Launcher;

/// Values over many magnitudes, so that the order of the additions shows in the bits.
fn spread(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let scale = 10f64.powi(((i * 7 + rank * 3) % 17) as i32 - 8);
            let sign = if (i + rank).is_multiple_of(2) {
                1.0
            } else {
                -1.0
            };
            (scale * sign * (1.0 + i as f64 / 3.0)) as f32
        })
        .collect()
}

/// Values that cancel: per element, a hash of rank and index picks huge magnitudes of both
/// signs or small ones (all exact in bf16), so that in most elements of a sum over three or
/// more ranks the order of the additions decides the bits (`2^100 + 1 - 2^100` is 0).
fn cancelling(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let mut h = (i as u64) << 8 | rank as u64;
            h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
            h ^= h >> 29;
            match h % 6 {
                0 | 1 => 2f32.powi(100),
                2 | 3 => -(2f32.powi(100)),
                4 => 1.0 + (h >> 40) as f32 % 4.0,
                _ => -0.0078125,
            }
        })
        .collect()
}

/// Asserts that `a` and `b` are equal, naming the first element that differs (the buffers
/// are too long to print).
fn same_bits(a: &[u32], b: &[u32], rank: usize) {
    assert_eq!(a.len(), b.len(), "rank {rank}: lengths");
    if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
        panic!(
            "rank {rank}: element {i} of {} differs: {:#010x} against {:#010x}",
            a.len(),
            a[i],
            b[i]
        );
    }
}

#[test]
fn the_shared_f32_path_gives_the_tensor_paths_bits() -> TestResult {
    // Uneven chunks (on three ranks and four), lengths that no vector width divides, and
    // buffers long enough for the all-reduce to be cut into ranges reduced by several threads
    // at once (the cuts inside chunks).
    let axes = vec!["x".to_string()];
    let short = 3 * 2048 + 7;
    let long = 300_001;
    for (mesh, dtype, kind, len) in [
        ("x=3", DType::F32, ReduceKind::Sum, short),
        ("x=3", DType::BF16, ReduceKind::Sum, short),
        ("x=3", DType::F32, ReduceKind::Max, short),
        ("x=3", DType::BF16, ReduceKind::Max, short),
        ("x=4", DType::F32, ReduceKind::Sum, short),
        ("x=4", DType::F16, ReduceKind::Min, short),
        ("x=2", DType::BF16, ReduceKind::Sum, short),
        ("x=4", DType::F32, ReduceKind::Sum, long),
        ("x=3", DType::BF16, ReduceKind::Max, long),
    ] {
        let mesh = DeviceMesh::parse(mesh)?;
        let n = mesh.num_devices();
        let ty = TensorType::new(dtype, [len]);
        let results = ThreadLauncher::default().launch(&mesh, |comm| {
            // bf16 operands must hold bf16 values.
            let values = if len == long { cancelling } else { spread };
            let x = Tensor::from_f64(
                ty.clone(),
                values(comm.rank(), len)
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            )?;
            let via_tensor = comm.all_reduce(&x, &axes, kind)?;
            let mut v: Vec<f32> = x
                .floats()
                .into_iter()
                .flatten()
                .map(|&v| v as f32)
                .collect();
            comm.all_reduce_f32(&mut v, &ty, &axes, kind)?;
            let scattered_ty = TensorType::new(dtype, [len / n * n]);
            let y = Tensor::from_f64(
                scattered_ty.clone(),
                spread(comm.rank() + 5, len / n * n)
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            )?;
            let rs_tensor = comm.reduce_scatter(&y, &axes, 0, kind)?;
            let yv: Vec<f32> = y
                .floats()
                .into_iter()
                .flatten()
                .map(|&v| v as f32)
                .collect();
            let mut rs = vec![0.0; len / n];
            comm.reduce_scatter_f32(&yv, &scattered_ty, &axes, 0, kind, &mut rs)?;
            Ok((via_tensor, v, rs_tensor, rs))
        })?;
        let mut first: Option<Vec<f32>> = None;
        for (rank, r) in results {
            let (t, v, rs_t, rs) = r?;
            let bits = |x: &[f64]| x.iter().map(|&e| (e as f32).to_bits()).collect::<Vec<_>>();
            let own = |x: &[f32]| x.iter().map(|e| e.to_bits()).collect::<Vec<_>>();
            same_bits(&bits(t.floats().expect("floats")), &own(&v), rank);
            same_bits(&bits(rs_t.floats().expect("floats")), &own(&rs), rank);
            // Every member holds the same bits.
            match &first {
                None => first = Some(v),
                Some(f) => same_bits(&own(f), &own(&v), rank),
            }
        }
    }
    Ok(())
}

#[test]
fn communicate_f32_checks_its_buffers() -> TestResult {
    let mesh = DeviceMesh::parse("x=2")?;
    let op = autopar_ir::Op::AllGather {
        axes: vec!["x".into()],
        dim: 0,
    };
    let ty = TensorType::new(DType::F32, [2, 3]);
    let results = ThreadLauncher::default().launch(&mesh, |comm: &mut dyn Collectives| {
        let x = vec![comm.rank() as f32; 6];
        let mut out = vec![0.0; 12];
        communicate_f32(comm, &op, Some((&ty, &x)), &mut out)?;
        // A result buffer of the wrong size is refused before anything moves (and dooms the
        // run, as every failed call does).
        let mut short = vec![0.0; 11];
        let refused = communicate_f32(comm, &op, Some((&ty, &x)), &mut short);
        Ok((out, refused))
    })?;
    for (rank, r) in results {
        let (out, refused) = r?;
        assert_eq!(out, [[0.0; 6], [1.0; 6]].concat(), "rank {rank}");
        assert!(
            matches!(refused, Err(RuntimeError::BadTensor { .. })),
            "{refused:?}"
        );
    }
    // An integer operand has no f32 path.
    let int = TensorType::new(DType::I32, [2]);
    let results = ThreadLauncher {
        options: CommOptions::default(),
    }
    .launch(&mesh, |comm| {
        comm.all_reduce_f32(&mut vec![0.0, 1.0], &int, &["x".into()], ReduceKind::Sum)
    })?;
    for (_, r) in results {
        let r = r.map_err(|e| e.innermost().clone());
        assert!(
            matches!(r, Err(RuntimeError::UnsupportedDType { .. })),
            "{r:?}"
        );
    }
    Ok(())
}

#[test]
fn library_groups_match_the_documented_order() -> TestResult {
    for (mesh, groups) in mesh_cases() {
        for group in &groups {
            for rank in 0..mesh.num_devices() {
                assert_eq!(
                    group_members(&mesh, rank, group)?,
                    expected_group(&mesh, rank, group)
                );
            }
        }
    }
    Ok(())
}

collectives_conformance!(in_process, |options| ThreadLauncher { options });

collectives_conformance!(in_process_f32, |options| F32Launcher {
    inner: ThreadLauncher { options },
    defaults: false,
});

collectives_conformance!(default_f32_methods, |options| F32Launcher {
    inner: ThreadLauncher { options },
    defaults: true,
});
