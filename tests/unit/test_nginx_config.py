"""The nginx configs in infra/nginx/ pass `nginx -t` (docs/fleet.md): the fleet test's rendered template,
and the production example with the shared proxy settings and route-key look-up as the snippets it
includes; both hash the edges by the user's route key, named as the edge names it. Needs Debian's
nginx (infra/nginx-install, which `make test` runs); no server is started. nginx running the look-up
against real edges: tests/integration/test_fleet.py."""

from __future__ import annotations

import datetime as dt
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from edge.routes.internal import ROUTE_KEY_HEADER, ROUTE_KEY_PATH
from tests.integration.nginx_harness import PROXY_CONF, ROUTE_KEY_CONF, TEMPLATE, nginx_binary, render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "infra" / "nginx" / "chatplane.example.conf"
# Where the production example keeps its route-key cache (tmpfs); the test puts it under its own folder.
EXAMPLE_ROUTE_KEY_CACHE = "/run/chatplane-route-keys"
NGINX_T_TIMEOUT_S = 30

pytestmark = pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (infra/nginx-install)")


def nginx_t(prefix: Path, conf: Path) -> subprocess.CompletedProcess[str]:
    binary = nginx_binary()
    assert binary
    return subprocess.run([binary, "-t", "-p", str(prefix), "-c", str(conf), "-g", f"pid {prefix / 'nginx.pid'};"],
                          capture_output=True, text=True, timeout=NGINX_T_TIMEOUT_S)


def self_signed(folder: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.chat.example")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1)).sign(key, hashes.SHA256()))
    (folder / "fullchain.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "privkey.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))


def test_the_fleet_tests_rendered_template_passes_nginx_t(tmp_path):
    conf = tmp_path / "nginx.conf"
    conf.write_text(render(tmp_path, 18080, ["127.0.0.1:18081", "127.0.0.1:18082"]))
    r = nginx_t(tmp_path, conf)
    assert r.returncode == 0, r.stderr


def test_the_production_example_passes_nginx_t_with_the_shared_proxy_settings(tmp_path):
    # As installed: the site in the http context, the proxy settings as snippets/chatplane-proxy.conf
    # (relative to the prefix, as /etc/nginx/ is for the system's nginx), the certificates in place.
    (tmp_path / "snippets").mkdir()
    shutil.copy(PROXY_CONF, tmp_path / "snippets" / "chatplane-proxy.conf")
    shutil.copy(ROUTE_KEY_CONF, tmp_path / "snippets" / "chatplane-route-key.conf")
    self_signed(tmp_path)
    site = EXAMPLE.read_text()
    assert EXAMPLE_ROUTE_KEY_CACHE in site
    site = site.replace("/etc/ssl/chatplane/", f"{tmp_path}/").replace(EXAMPLE_ROUTE_KEY_CACHE, f"{tmp_path}/route_keys")
    assert "include snippets/chatplane-proxy.conf;" in site and "include snippets/chatplane-route-key.conf;" in site
    (tmp_path / "site.conf").write_text(site)
    conf = tmp_path / "nginx.conf"
    conf.write_text(f"error_log {tmp_path}/error.log;\nevents {{}}\nhttp {{\n    include {tmp_path}/site.conf;\n}}\n")
    r = nginx_t(tmp_path, conf)
    assert r.returncode == 0, r.stderr
    # The settings SSE depends on are the ones nginx loaded (not commented out or overridden).
    proxy = PROXY_CONF.read_text()
    for line in ("proxy_buffering off;", "proxy_http_version 1.1;", 'proxy_set_header Connection "";', "proxy_read_timeout 180s;"):
        assert f"\n{line}" in proxy, line


def test_both_configs_pin_a_user_by_the_edges_route_key_and_never_by_the_token_alone():
    # One user holding two tokens must reach one edge (its burst bucket is that edge's): the sticky
    # upstream hashes the route key the edge gives, the token only when the edge gave none.
    for conf in (TEMPLATE.read_text(), EXAMPLE.read_text()):
        assert "hash $chatplane_user_hash_key consistent;" in conf
        assert "hash $http_authorization" not in conf
        assert "upstream chatplane_route_key_edges {" in conf and "keys_zone=chatplane_route_keys:" in conf
        assert "map $chatplane_route_key $chatplane_user_hash_key {" in conf
        assert '""      $http_authorization;' in conf and "default $chatplane_route_key;" in conf
        # The edge's route is the proxy's, never passed on for the public.
        assert "location /internal/ { return 404; }" in conf
    proxy = PROXY_CONF.read_text()
    # The variable nginx reads is the header the edge writes ($upstream_http_ + lower case, "-" as "_").
    upstream_var = "$upstream_http_" + ROUTE_KEY_HEADER.lower().replace("-", "_")
    assert "\nauth_request /_chatplane_route_key;" in proxy
    assert f"\nauth_request_set $chatplane_route_key {upstream_var};" in proxy
    look_up = ROUTE_KEY_CONF.read_text()
    assert f"proxy_pass http://chatplane_route_key_edges{ROUTE_KEY_PATH};" in look_up
    # A look-up carries no body and no Content-Length (the edge would wait for the missing body), is
    # a GET whatever the client's method, and is cached per token.
    for line in ("proxy_pass_request_body off;", 'proxy_set_header Content-Length "";', "proxy_method GET;",
                 "proxy_cache_key $http_authorization;", "internal;"):
        assert f"\n    {line}" in look_up, line
    # Any other answer of the look-up (an older edge's 404, a refusal, a failure) lets the request go
    # on without a key: auth_request would fail it with nginx's 500 (or a bare 401 or 403).
    fallback = re.search(r"\n    error_page ([\d ]+) = @chatplane_no_route_key;", look_up)
    assert fallback and {"400", "401", "403", "404", "500", "502", "503", "504"} <= set(fallback.group(1).split())
    assert "location @chatplane_no_route_key {\n    return 204;\n}" in look_up
