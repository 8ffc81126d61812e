//! What the examples share: the exit status of `main`, with an error printed as a sentence.

use std::process::ExitCode;

use kdtree_engine::Result;

/// Success, or the error's message on stderr and a failure status.
pub fn exit_with(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
