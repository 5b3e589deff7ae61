"""The host's URLs: the admin, the REST API, the protocol layers, health and metrics."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from agents.api.mcp_oauth import oauth_callback
from sagehost import metrics, views

urlpatterns = [
    path("", views.home, name="home"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("sagehost.api_urls")),
    path("v1/", include("agents.protocols.openai")),
    path("lg/", include("agents.protocols.langgraph")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("mcp/oauth/callback", oauth_callback, name="mcp-oauth-callback"),
]

handler400 = "sageproject.api.bad_request"
handler403 = "sageproject.api.permission_denied"
handler404 = "sageproject.api.not_found"
handler500 = "sageproject.api.server_error"
