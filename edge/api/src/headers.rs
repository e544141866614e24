//! The HTTP header names that cross between the gateway or the control plane and an
//! edge's proxy, and between edges. Defined here once: a renamed header on one side
//! only would silently drop what it carries.

/// The cluster key, with which the gateway and the control plane authenticate to an
/// edge's proxy. The proxy removes it before forwarding anything to a sandbox.
pub const EDGE_KEY_HEADER: &str = "x-opendsec-edge-key";

/// The port inside the sandbox a forwarded request is for (absent: the agent).
pub const PORT_HEADER: &str = "x-opendsec-port";

/// The name of the edge pulling a transfer from another edge.
pub const EDGE_HEADER: &str = "x-opendsec-edge";

/// The pulling edge's transfer token ([`crate::transfer_token`]).
pub const TRANSFER_TOKEN_HEADER: &str = "x-opendsec-transfer-token";

/// An image upload to an edge (`PUT /images/import`): the image's name.
pub const IMAGE_HEADER: &str = "x-opendsec-image";

/// An image upload to an edge: the log index of the `ImportImage` that asked for it (the
/// edge waits until its slice holds it).
pub const IMPORT_INDEX_HEADER: &str = "x-opendsec-import-index";

/// A request to a sandbox: the log index of the last change to the sandbox that the
/// gateway routing it had seen. The edge holds the request until its slice holds that
/// index and the sandbox has settled there (a pause and a resume recorded back to back
/// are both carried out first), so the request never meets an agent that a pause the
/// caller saw acknowledged is ending.
pub const AFTER_HEADER: &str = "x-opendsec-after";
