"""Dashboard routes of the tenants app (mounted at the site root)."""
from django.contrib.auth import views as auth_views
from django.urls import path

from . import views

app_name = "tenants"

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="registration/login.html", redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.home, name="home"),
    path("switch/", views.switch, name="switch"),
    path("keys/", views.keys, name="keys"),
    path("keys/<int:pk>/revoke/", views.revoke_key, name="revoke_key"),
    path("members/", views.members, name="members"),
    path("members/<int:pk>/role/", views.change_role, name="change_role"),
    path("members/<int:pk>/remove/", views.remove_member, name="remove_member"),
    path("members/leave/", views.leave, name="leave"),
    path("members/invitations/<int:pk>/revoke/", views.revoke_invitation, name="revoke_invitation"),
    # as the invitee: their own invitations, by id or by the e-mailed link's token
    path("invitations/", views.invitations, name="invitations"),
    path("invitations/<int:pk>/accept/", views.accept_invitation, name="accept_invitation"),
    path("invitations/<int:pk>/decline/", views.decline_invitation, name="decline_invitation"),
    path("invitations/link/<str:token>/", views.invitation_link, name="invitation_link"),
]
