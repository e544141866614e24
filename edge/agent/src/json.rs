//! Protojson leniency helpers for request messages: `null` means default,
//! integers may come as numbers or strings.

use serde::{Deserialize, Deserializer};

pub fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

pub fn opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    use serde::de::Error;
    match Option::<serde_json::Value>::deserialize(d)? {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Number(n)) => n
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| D::Error::custom("expected uint32")),
        Some(serde_json::Value::String(s)) => s.parse().map(Some).map_err(|_| D::Error::custom("expected uint32")),
        Some(_) => Err(D::Error::custom("expected uint32")),
    }
}

pub fn u32_or_zero<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    Ok(opt_u32(d)?.unwrap_or(0))
}

pub fn b64(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(data)
}

pub fn unb64(s: &str) -> Result<Vec<u8>, crate::connect::RpcError> {
    use base64::Engine;
    // protojson accepts standard or URL-safe alphabets, padded or not.
    let t = s.trim_end_matches('=');
    base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(t)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(t))
        .map_err(|_| crate::connect::RpcError::invalid("bad base64 in bytes field"))
}
