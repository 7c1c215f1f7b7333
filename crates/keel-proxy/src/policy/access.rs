//! `allow` and `deny` of a listener or a route: which client addresses it serves. Compiled
//! once per route target when the routing is built; checked in `leg::forward` before anything
//! else the target does (redirect, rate limits, rewrites, the pick), and for a TCP listener
//! when a connection opens.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::config::route::Cidr;

/// One listener's or route's lists, compiled: the rules most specific first, so that the
/// first match is the longest prefix (`deny` first among equals).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AccessList {
    /// (block, allowed), longest prefix first.
    rules: Box<[(IpNet, bool)]>,
    /// What a client no rule matches gets: refused when there is an `allow` list.
    default_allow: bool,
}

impl AccessList {
    /// The lists as configured; `None` when both are empty (everyone is served).
    pub(crate) fn new(allow: &[Cidr], deny: &[Cidr]) -> Option<Self> {
        if allow.is_empty() && deny.is_empty() {
            return None;
        }
        let mut rules: Vec<(IpNet, bool)> = deny
            .iter()
            .map(|c| (c.0, false))
            .chain(allow.iter().map(|c| (c.0, true)))
            .collect();
        // Stable: at equal length a deny (listed first) stays ahead of an allow.
        rules.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
        Some(Self {
            rules: rules.into(),
            default_allow: allow.is_empty(),
        })
    }

    /// True if the list lets `ip` in. An IPv4 client seen on an IPv6 socket
    /// (`::ffff:192.0.2.7`) is taken as its IPv4 address.
    pub(crate) fn permits(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.rules
            .iter()
            .find(|(net, _)| net.contains(&ip))
            .map_or(self.default_allow, |(_, allowed)| *allowed)
    }
}

/// The lists a request to one target passes: its listener's, then its route's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Access {
    pub(crate) listener: Option<AccessList>,
    pub(crate) route: Option<AccessList>,
}

/// Which list refused a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    Listener,
    Route,
}

impl Refused {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Refused::Listener => "the listener's",
            Refused::Route => "the route's",
        }
    }
}

impl Access {
    /// `None` when neither the listener nor the route has a list.
    pub(crate) fn new(listener: Option<AccessList>, route: Option<AccessList>) -> Option<Self> {
        (listener.is_some() || route.is_some()).then_some(Self { listener, route })
    }

    /// Checks the client's address (`None`: a trusted proxy forwarded one that is not an
    /// address, refused by any list).
    pub(crate) fn check(&self, ip: Option<IpAddr>) -> Result<(), Refused> {
        let ok = |l: &Option<AccessList>| {
            l.as_ref()
                .is_none_or(|l| ip.is_some_and(|ip| l.permits(ip)))
        };
        if !ok(&self.listener) {
            return Err(Refused::Listener);
        }
        if !ok(&self.route) {
            return Err(Refused::Route);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidrs(v: &[&str]) -> Vec<Cidr> {
        v.iter()
            .map(|s| Cidr::try_from(s.to_string()).unwrap())
            .collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_longest_prefix_decides_and_deny_wins_ties() {
        let l = AccessList::new(&cidrs(&["127.0.0.1"]), &cidrs(&["127.0.0.0/8"])).unwrap();
        assert!(
            l.permits(ip("127.0.0.1")),
            "the /32 allow beats the /8 deny"
        );
        assert!(!l.permits(ip("127.0.0.2")));
        assert!(!l.permits(ip("10.0.0.1")), "an allow list refuses the rest");
        let tie = AccessList::new(&cidrs(&["10.0.0.0/8"]), &cidrs(&["10.0.0.0/8"])).unwrap();
        assert!(!tie.permits(ip("10.1.2.3")));
    }

    #[test]
    fn a_deny_list_alone_serves_everyone_else() {
        let l = AccessList::new(&[], &cidrs(&["192.0.2.0/24", "2001:db8::/32"])).unwrap();
        assert!(!l.permits(ip("192.0.2.9")));
        assert!(!l.permits(ip("2001:db8::1")));
        assert!(l.permits(ip("198.51.100.1")));
        assert!(l.permits(ip("::1")));
        assert!(
            !l.permits(ip("::ffff:192.0.2.9")),
            "IPv4 on an IPv6 socket is the IPv4 address"
        );
        assert!(AccessList::new(&[], &[]).is_none());
    }

    #[test]
    fn the_listener_list_then_the_routes() {
        let a = Access::new(
            AccessList::new(&[], &cidrs(&["10.0.0.0/8"])),
            AccessList::new(&cidrs(&["10.0.0.0/8", "127.0.0.0/8"]), &[]),
        )
        .unwrap();
        assert_eq!(a.check(Some(ip("10.0.0.1"))), Err(Refused::Listener));
        assert_eq!(a.check(Some(ip("192.0.2.1"))), Err(Refused::Route));
        assert_eq!(a.check(Some(ip("127.0.0.1"))), Ok(()));
        assert_eq!(a.check(None), Err(Refused::Listener));
        assert!(Access::new(None, None).is_none());
    }

    #[test]
    fn cidr_text_is_checked() {
        assert_eq!(
            cidrs(&["192.0.2.7"])[0].0,
            "192.0.2.7/32".parse::<IpNet>().unwrap()
        );
        let e = Cidr::try_from("10.0.0.1/8".to_string()).unwrap_err();
        assert!(
            matches!(e, crate::config::route::CidrError::HostBits { .. }),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(
            e.contains("\"10.0.0.0/8\"") && e.contains("\"10.0.0.1/32\""),
            "{e}"
        );
        let e = Cidr::try_from("10.0.0.300".to_string()).unwrap_err();
        assert!(
            matches!(e, crate::config::route::CidrError::Syntax { .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("not an IP address"), "{e}");
    }
}
