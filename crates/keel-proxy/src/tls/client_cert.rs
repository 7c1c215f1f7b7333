//! The client certificate a listener with `client_ca` verified: its subject, names and
//! fingerprint as text, made once per connection at the handshake (header variables and the
//! access log then share them; a connection without one pays nothing per request).

use std::fmt::Write;

use rustls::pki_types::CertificateDer;

/// A verified client certificate, as the header variables and the access log show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    /// The subject's distinguished name in RFC 4514 form, most specific first
    /// (`CN=alice,O=Example\, Inc.,C=DE`), as NGINX's `$ssl_client_s_dn`.
    pub subject: Box<str>,
    /// The subject alternative names: DNS names and URIs, comma-separated.
    pub san: Box<str>,
    /// SHA-256 of the certificate's DER, lower-case hex.
    pub fingerprint: Box<str>,
}

impl ClientCert {
    /// Reads the leaf of a verified chain; `None` if webpki cannot parse it (it just did).
    pub fn of(leaf: &CertificateDer<'_>) -> Option<ClientCert> {
        let cert = webpki::EndEntityCert::try_from(leaf).ok()?;
        let subject = distinguished_name(cert.subject());
        let mut san = String::new();
        for name in cert.valid_dns_names().chain(cert.valid_uri_names()) {
            if !san.is_empty() {
                san.push(',');
            }
            push_escaped(&mut san, name.as_bytes(), false);
        }
        let digest = ring::digest::digest(&ring::digest::SHA256, leaf.as_ref());
        let mut fingerprint = String::with_capacity(64);
        for b in digest.as_ref() {
            let _ = write!(fingerprint, "{b:02x}");
        }
        Some(ClientCert {
            subject: subject.into(),
            san: san.into(),
            fingerprint: fingerprint.into(),
        })
    }
}

/// One DER element: (tag, contents, the rest of `der`); `None` if malformed.
fn element(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |a, b| a << 8 | *b as usize);
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The short names RFC 4514 (and NGINX, OpenSSL) give the usual attribute types, by the DER
/// of their object identifier.
const NAMES: &[(&[u8], &str)] = &[
    (&[0x55, 0x04, 0x03], "CN"),
    (&[0x55, 0x04, 0x05], "serialNumber"),
    (&[0x55, 0x04, 0x06], "C"),
    (&[0x55, 0x04, 0x07], "L"),
    (&[0x55, 0x04, 0x08], "ST"),
    (&[0x55, 0x04, 0x09], "STREET"),
    (&[0x55, 0x04, 0x0a], "O"),
    (&[0x55, 0x04, 0x0b], "OU"),
    (
        &[0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x01],
        "UID",
    ),
    (
        &[0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x19],
        "DC",
    ),
    (
        &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x09, 0x01],
        "emailAddress",
    ),
];

/// A Name's contents (a SEQUENCE OF RelativeDistinguishedName) in RFC 4514 form: the last
/// RDN first, `+` between the attributes of one RDN. Unknown types are dotted OIDs; values that
/// are not strings are `#` and their DER in hex, as RFC 4514 says. Every byte that is not
/// printable ASCII is escaped (`\XX`), so the text is always a valid header value.
fn distinguished_name(mut der: &[u8]) -> String {
    let mut rdns = Vec::new();
    while let Some((0x31, set, rest)) = element(der) {
        rdns.push(set);
        der = rest;
    }
    let mut out = String::new();
    for (i, mut set) in rdns.into_iter().rev().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let mut first = true;
        while let Some((0x30, atv, rest)) = element(set) {
            set = rest;
            let Some((0x06, oid, value)) = element(atv) else {
                continue;
            };
            if !first {
                out.push('+');
            }
            first = false;
            match NAMES.iter().find(|(o, _)| *o == oid) {
                Some((_, name)) => out.push_str(name),
                None => push_oid(&mut out, oid),
            }
            out.push('=');
            match element(value) {
                // UTF8String, PrintableString, T61String, IA5String.
                Some((0x0c | 0x13 | 0x14 | 0x16, text, _)) => push_escaped(&mut out, text, true),
                _ => {
                    out.push('#');
                    for b in value {
                        let _ = write!(out, "{b:02x}");
                    }
                }
            }
        }
    }
    out
}

/// An OBJECT IDENTIFIER's contents in dotted form.
fn push_oid(out: &mut String, oid: &[u8]) {
    let mut arcs = Vec::new();
    let mut n: u64 = 0;
    for b in oid {
        n = n << 7 | (b & 0x7f) as u64;
        if b & 0x80 == 0 {
            arcs.push(n);
            n = 0;
        }
    }
    let Some(&first) = arcs.first() else { return };
    let (a, b) = if first < 80 {
        (first / 40, first % 40)
    } else {
        (2, first - 80)
    };
    let _ = write!(out, "{a}.{b}");
    for arc in &arcs[1..] {
        let _ = write!(out, ".{arc}");
    }
}

/// Appends `value` with RFC 4514's escapes (when `dn`: `,+"\<>;`, a leading `#` or space and
/// a trailing space) and `\XX` for every byte that is not printable ASCII.
fn push_escaped(out: &mut String, value: &[u8], dn: bool) {
    for (i, &b) in value.iter().enumerate() {
        let special = dn
            && (matches!(b, b',' | b'+' | b'"' | b'\\' | b'<' | b'>' | b';')
                || (i == 0 && (b == b'#' || b == b' '))
                || (i + 1 == value.len() && b == b' '));
        if special {
            out.push('\\');
            out.push(b as char);
        } else if (0x20..0x7f).contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "\\{b:02X}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DER element with a short length.
    fn tlv(tag: u8, contents: &[u8]) -> Vec<u8> {
        let mut v = vec![tag, contents.len() as u8];
        v.extend_from_slice(contents);
        v
    }

    fn atv(oid: &[u8], tag: u8, value: &[u8]) -> Vec<u8> {
        tlv(0x30, &[tlv(0x06, oid), tlv(tag, value)].concat())
    }

    #[test]
    fn a_name_is_written_most_specific_first_with_rfc_4514_escapes() {
        let name = [
            tlv(0x31, &atv(&[0x55, 0x04, 0x06], 0x13, b"DE")),
            tlv(0x31, &atv(&[0x55, 0x04, 0x0a], 0x0c, b"Example, Inc.")),
            // A multi-valued RDN: two attributes joined by `+`.
            tlv(
                0x31,
                &[
                    atv(&[0x55, 0x04, 0x03], 0x0c, "#älice ".as_bytes()),
                    atv(
                        &[0x2b, 0x06, 0x01, 0x04, 0x01, 0x82, 0x37, 0x01],
                        0x02,
                        &[5],
                    ),
                ]
                .concat(),
            ),
        ]
        .concat();
        assert_eq!(
            distinguished_name(&name),
            "CN=\\#\\C3\\A4lice\\ +1.3.6.1.4.1.311.1=#020105,O=Example\\, Inc.,C=DE"
        );
        assert_eq!(distinguished_name(&[]), "");
        // Malformed DER ends the name where it breaks, never panics.
        assert_eq!(distinguished_name(&[0x31, 0x7f, 0x30]), "");
    }

    #[test]
    fn long_lengths_are_read() {
        let value = vec![b'a'; 200];
        let mut der = vec![0x0c, 0x81, 200];
        der.extend_from_slice(&value);
        let (tag, contents, rest) = element(&der).unwrap();
        assert_eq!((tag, contents.len(), rest.len()), (0x0c, 200, 0));
        assert!(element(&[0x0c, 0x81]).is_none());
        assert!(element(&[0x0c, 0x85, 1, 1, 1, 1, 1]).is_none());
    }
}
