from __future__ import annotations

from django import forms
from django.contrib import admin

from pooling.models import RECORD_FIELDS, ModelRecord
from sageproject import admin_display as show


class ModelRecordForm(forms.ModelForm):
    # Write-only: the stored secret is never rendered back into the page.
    api_key = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Leave empty to keep the stored credentials. Never shown again once saved.",
    )
    clear_api_key = forms.BooleanField(required=False, help_text="Remove the stored credentials.")

    class Meta:
        model = ModelRecord
        fields = ["owner", *RECORD_FIELDS]

    def save(self, commit: bool = True) -> ModelRecord:
        record = super().save(commit=False)
        if self.cleaned_data.get("clear_api_key"):
            record.api_key = ""
        elif self.cleaned_data.get("api_key"):
            record.api_key = self.cleaned_data["api_key"]
        if commit:
            record.save()
        return record


@admin.register(ModelRecord)
class ModelRecordAdmin(admin.ModelAdmin):
    form = ModelRecordForm
    list_display = ["name", "protocol", "model", "endpoint", "owner_or_shared", "credentials",
                    "updated"]
    list_filter = ["protocol", ("owner", admin.EmptyFieldListFilter)]
    search_fields = ["name", "model", "base_url", "owner__username"]
    list_select_related = ["owner"]
    readonly_fields = ["credentials", "created_at", "updated_at"]
    fields = [
        "owner",
        *RECORD_FIELDS,
        "api_key",
        "clear_api_key",
        "credentials",
        "created_at",
        "updated_at",
    ]

    @admin.display(description="base URL", ordering="base_url")
    def endpoint(self, obj: ModelRecord) -> str:
        return show.preview(obj.base_url, 48)

    @admin.display(description="owner", ordering="owner")
    def owner_or_shared(self, obj: ModelRecord) -> str:
        return obj.owner.username if obj.owner_id else "shared"

    updated = show.time_column("updated_at")

    @admin.display(description="credentials")
    def credentials(self, obj: ModelRecord) -> str:
        return "•••••••• (stored)" if obj.has_credentials else "none"
