//! The built-in subcommands, one module each.

pub mod encode;
pub mod eval;
pub mod index;
pub mod search;
