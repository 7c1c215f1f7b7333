//! The active health check of gRPC clusters: `grpc.health.v1.Health/Check` on a connection of
//! its own, passed when the endpoint answers `SERVING`.

use bytes::{BufMut, Bytes, BytesMut};
use hyper::http::{Request, Uri};

use crate::control::health_error::CheckFailed;
use crate::upstream::cluster::EndpointEntry;

/// A gRPC message frame: not compressed, its length, the bytes.
fn frame(message: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + message.len());
    b.put_u8(0);
    b.put_u32(message.len() as u32);
    b.put_slice(message);
    b.freeze()
}

/// `HealthCheckResponse.status` from the message's bytes (field 1, a varint); 0 (UNKNOWN)
/// if absent.
fn serving_status(mut msg: &[u8]) -> Result<u64, &'static str> {
    fn varint(b: &mut &[u8]) -> Result<u64, &'static str> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = b.split_first().ok_or("truncated varint")?;
            *b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint too long")
    }
    let mut status = 0;
    while !msg.is_empty() {
        let key = varint(&mut msg)?;
        match (key >> 3, key & 7) {
            (1, 0) => status = varint(&mut msg)?,
            (_, 0) => {
                varint(&mut msg)?;
            }
            (_, 2) => {
                let n = varint(&mut msg)? as usize;
                msg = msg.get(n..).ok_or("truncated field")?;
            }
            _ => return Err("unexpected field type"),
        }
    }
    Ok(status)
}

/// One `grpc.health.v1.Health/Check` for `service` on a new HTTP/2 connection (TLS when
/// `tls`): passes if the endpoint answers `SERVING`.
pub(crate) async fn probe(
    entry: &EndpointEntry,
    tls: bool,
    service: &str,
) -> Result<(), CheckFailed> {
    let conn = entry.pool.connect().await.map_err(CheckFailed::Connect)?;
    let (send, driver) = h2::client::handshake(conn.io)
        .await
        .map_err(CheckFailed::Handshake)?;
    // Ends once the probe's handles are dropped.
    tokio::spawn(async move {
        let _ = driver.await;
    });
    let uri = Uri::builder()
        .scheme(if tls { "https" } else { "http" })
        .authority(entry.authority.as_str())
        .path_and_query("/grpc.health.v1.Health/Check")
        .build()?;
    let mut request = Request::post(uri)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("user-agent", "keel-health-check")
        .body(())?;
    *request.version_mut() = hyper::Version::HTTP_2;
    let mut send = send.ready().await?;
    let (response, mut stream) = send.send_request(request, false)?;
    // HealthCheckRequest { service = 1 }: absent when empty.
    let mut msg = Vec::with_capacity(service.len() + 2);
    if !service.is_empty() {
        msg.push(0x0a);
        msg.push(service.len().min(127) as u8);
        msg.extend_from_slice(&service.as_bytes()[..service.len().min(127)]);
    }
    stream.send_data(frame(&msg), true)?;
    let response = response.await?;
    if response.status() != 200 {
        return Err(CheckFailed::Status(response.status().as_u16()));
    }
    let (head, mut body) = response.into_parts();
    let mut data = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await?;
    let code = trailers
        .as_ref()
        .and_then(crate::exchange::grpc::grpc_status)
        .or_else(|| crate::exchange::grpc::grpc_status(&head.headers));
    match code {
        Some(0) => {}
        Some(c) => return Err(CheckFailed::GrpcStatus(c)),
        None => return Err(CheckFailed::NoGrpcStatus),
    }
    if data.len() < 5 || data[0] != 0 {
        return Err(CheckFailed::Response("no uncompressed HealthCheckResponse"));
    }
    let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
    let msg = data
        .get(5..5 + len)
        .ok_or(CheckFailed::Response("truncated HealthCheckResponse"))?;
    match serving_status(msg).map_err(CheckFailed::Response)? {
        1 => Ok(()),
        s => Err(CheckFailed::NotServing(
            ["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"]
                .get(s as usize)
                .unwrap_or(&"?"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_responses_decode_and_frames_are_framed() {
        assert_eq!(serving_status(&[0x08, 0x01]), Ok(1));
        assert_eq!(serving_status(&[0x08, 0x02]), Ok(2));
        assert_eq!(serving_status(&[]), Ok(0));
        // An unknown length-delimited field before the status is skipped.
        assert_eq!(serving_status(&[0x12, 0x01, 0x41, 0x08, 0x01]), Ok(1));
        assert!(serving_status(&[0x08]).is_err());
        assert_eq!(&frame(b"ab")[..], &[0, 0, 0, 0, 2, b'a', b'b']);
    }
}
