from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from sageproject import api, metrics

urlpatterns = [
    path("", api.home, name="home"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("sageproject.api_urls")),
    path("v1/", include("agents.protocols.openai")),
    path("lg/", include("agents.protocols.langgraph")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path("healthz", api.healthz, name="healthz"),
    path("readyz", api.readyz, name="readyz"),
    path("metrics", metrics.metrics_view, name="metrics"),
]

handler400 = "sageproject.api.bad_request"
handler403 = "sageproject.api.permission_denied"
handler404 = "sageproject.api.not_found"
handler500 = "sageproject.api.server_error"
