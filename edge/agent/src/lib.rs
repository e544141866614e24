//! The agent's wire layer, as a library beside its binary (`main.rs`): the Connect
//! framing (`connect`), the protojson leniency helpers (`json`) and the envd request
//! messages (`requests`). The binary is everything else; the fuzz targets (`fuzz/`)
//! decode arbitrary bytes with these same modules.

pub mod connect;
pub mod json;
pub mod requests;
