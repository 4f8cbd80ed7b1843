//! The collectives conformance suite (`conformance/collectives.rs`) over the in-process
//! communicator, and the library's group order held to the suite's independent one.

#[path = "conformance/collectives.rs"]
mod collectives;

use autopar_runtime::ThreadLauncher;
use autopar_runtime::comm::group_members;
use collectives::{TestResult, expected_group, mesh_cases};

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
