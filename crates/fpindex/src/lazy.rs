//! Lazy lookup and the auto mode (filled in below).
use crate::error::Result;
use crate::index::{Index, Mode};

pub(crate) fn choose_mode(_ix: &mut Index) -> Result<Mode> {
    Ok(Mode::Eager)
}
